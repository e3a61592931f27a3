"""FeatureDrafter: the Drafter protocol over an EAGLE-3 head (specsplit.models.eagle3).

The head drafts from the target's own hidden states. The verifier computes them while it verifies
(`SeqAdd.feature_layers` asks it to) and returns, with each step's result, the fused features of
the positions it committed (`VerifyResult.features`, rows from `features_start`); the step hands
them to the drafter with the next propose (`ProposeRequest.features`), with the tokens emitted
since. Per sequence the drafter keeps:

    tokens        prompt + every final token
    cache         the head's KV: `committed` entries from target features, then the chain's
    next_pos      the position after the last committed entry (entries need not be contiguous:
                  features that never arrived -- speculation was off, the drafter restarted --
                  leave a gap the head simply does not attend to)
    last_h        the head's output at the last committed entry (it predicts tokens[next_pos + 1])
    drafted       the chain of drafts past `tokens`, with each sampled draft's q row

Propose: drop the chain's entries, add an entry per new feature row (feature f_t with the token
x_{t+1}), then run the chain: the known tokens past the last entry's prediction (`after` while
pre-drafting, or tokens whose features are missing) are fed as chain entries, then k drafts are
drawn one by one, each fed back with the head's own output as its hidden input -- exactly the
training-time-test unroll the head was trained with. Without any features yet (the first step,
or after a restart until the next verify) it proposes nothing and the step decodes target-only.

Drafts are drawn from q = the head's distribution over its draft vocabulary (the target's ids
outside it get q = 0) under the request's temperature / top-k / top-p, with the same keyed random
numbers and coupled sampling as the model drafter, so rejection sampling stays lossless.

Structured output: with a compiler (`grammars`; colocated, the verifier's; a drafter service, its
own over the target's tokenizer: factory.feature_grammars), a sequence with a grammar, once it is
compiled (engine.DraftGrammar: never waited for), drafts from the head's logits masked by its
matcher after the tokens and the chain so far (q is that masked distribution, so rejection
sampling stays exact), as the model drafter does: its
drafts stay in the grammar instead of being cut by the verifier. Where the grammar allows no token
of the draft vocabulary, the chain ends there; where the matcher cannot follow (a chain it refuses),
the draft is unmasked and the verifier cuts. Such sequences draft chains, no tree leaves.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F

from specsplit.draft_tree import runner_up, tree_eligible
from specsplit.engine import (DraftGrammar, EngineError, chain_proposal, chain_tail, check_propose, check_seq_adds,
                              draft_grammar, fetch_q_rows, ingest_chain, sample_drafts)
from specsplit.kv.meters import tensor_storage_bytes
from specsplit.models.eagle3 import DraftCache, Eagle3Head
from specsplit.models import int8_linear
from specsplit.models.int8_linear import Int8Linear
from specsplit.protocols import DrafterTraits, Proposal, ProposeRequest, QRow, RowRequest, SeqAdd
from specsplit.sampling.grammar import GrammarCompiler, apply_masks
from specsplit.sampling.params import SamplingParams
from specsplit.sampling.probs import greedy_ids
from specsplit.sampling.rng import SeqRandom

log = logging.getLogger(__name__)
ENV_INT8 = "SPECSPLIT_DRAFT_INT8"  # "0": the head's Q8_0 linears keep fp32 activations (quantized())


@dataclass
class _FSeq:
    tokens: list[int]
    params: SamplingParams
    rng: SeqRandom
    cache: DraftCache = field(default_factory=DraftCache)
    committed: int = 0  # cache entries made from target features
    next_pos: int = 0  # position after the last committed entry
    last_h: torch.Tensor | None = None  # [1, H] head output at the last committed entry
    drafted: list[int] = field(default_factory=list)  # the chain of drafts past `tokens`
    q_rows: list = field(default_factory=list)  # per chain draft: [V] q row (sampled) or None
    prompt_len: int = 0  # tokens before the output (a resumed sequence's generated ones excluded)
    grammar: DraftGrammar | None = None  # the request's matcher (structured output), with a compiler


class FeatureDrafter(DrafterTraits):
    """EAGLE-3 drafting; implements the Drafter protocol (specsplit.protocols)."""

    grammars: GrammarCompiler | None = None  # structured output: drafts follow the grammar's mask

    side = "drafter"

    def __init__(self, head: Eagle3Head, embedding: torch.Tensor | torch.nn.Module, max_model_len: int):
        self.head = head
        # [V, H] the target's token embedding (shared, frozen), or the module that looks rows up in
        # it (a GGUF target's quantized embedding, models/gguf_native.QuantEmbedding: no fp32 copy)
        self.embedding = embedding
        self.max_model_len = max_model_len
        self.seqs: dict[str, _FSeq] = {}
        self.step_costs = None  # calibration.StepCosts (factory._ready_head)
        # a greedy chain ends where the product of the head's top-1 probabilities falls below this
        # (SpecConfig.draft_stop; 0: always k)
        self.stop_below = 0.0

    # ---- what the step needs to know --------------------------------------------------------
    @property
    def feature_layers(self) -> tuple[int, ...]:
        """Target layers whose outputs the verifier must send (fused in this order)."""
        return tuple(self.head.cfg.aux_layers)

    @property
    def feature_size(self) -> int:
        return len(self.head.cfg.aux_layers) * self.head.cfg.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.head.cfg.vocab_size

    @property
    def num_running(self) -> int:
        return len(self.seqs)

    def cache_bytes(self) -> int:
        """Bytes held by every sequence's head KV (the drafter's whole per-sequence state)."""
        return sum(s.cache.nbytes() for s in self.seqs.values())

    @staticmethod
    def cache_bytes_per_token(head: Eagle3Head, dtype: torch.dtype) -> int:
        c = head.cfg
        return 2 * c.num_key_value_heads * c.hd * torch.tensor([], dtype=dtype).element_size()

    def cache_bound_bytes(self, max_num_seqs: int) -> int:
        """The most the head's KV caches hold: max_num_seqs sequences of max_model_len rows (a
        DraftCache never grows past its limit). The memory plan counts it (factory)."""
        return max_num_seqs * self.max_model_len * self.cache_bytes_per_token(self.head, self.head.fc.weight.dtype)

    @property
    def untracked_weight_bytes(self) -> int:
        """Packed (opaque) copies of the head's weights, which storage tracking cannot see."""
        return int(getattr(self.head, "untracked_weight_bytes", 0) or 0)

    # ---- lifecycle ----------------------------------------------------------------------------
    def add(self, seqs: Sequence[SeqAdd]) -> None:
        check_seq_adds(seqs, self.seqs, self.side, self.vocab_size, self.max_model_len)
        for s in seqs:
            self.seqs[s.seq_id] = _FSeq(list(s.prompt_token_ids), s.params, SeqRandom(s.params.seed, self.side),
                                        cache=DraftCache(self.max_model_len),
                                        prompt_len=len(s.prompt_token_ids) - s.generated,
                                        grammar=draft_grammar(self.grammars, s.seq_id, s.params))

    def release(self, seq_ids: Sequence[str], finished: bool = False) -> None:
        for seq_id in seq_ids:
            self.seqs.pop(seq_id, None)

    def _get(self, seq_id: str) -> _FSeq:
        try:
            return self.seqs[seq_id]
        except KeyError:
            raise EngineError(f"unknown sequence {seq_id!r} on the drafter: add it first") from None

    # ---- propose --------------------------------------------------------------------------------
    def propose(self, reqs: Sequence[ProposeRequest]) -> list[Proposal]:
        seqs = [self._get(r.seq_id) for r in reqs]
        for r, s in zip(reqs, seqs):
            check_propose(r, s, self.vocab_size, self.max_model_len)
            f = r.features
            if f is not None and (f.dim() != 2 or f.shape[1] != self.feature_size):
                raise EngineError(f"sequence {r.seq_id!r}: features of shape {tuple(f.shape)}, the head reads "
                                  f"[rows, {self.feature_size}] (layers {self.feature_layers})")
        out = []
        for r, s in zip(reqs, seqs):
            self._ingest(s, r.new_token_ids, r.pending_drafts)
            if r.features is not None and r.features.shape[0]:
                self._commit_features(s, r.features, r.features_start)
            out.append(self._draft(r, s))
        return out

    def _ingest(self, s: _FSeq, new: Sequence[int], after: Sequence[int]) -> None:
        """New final tokens and the chain (engine.ingest_chain); the chain's head-KV entries go (the
        next verify's features replace them)."""
        ingest_chain(s, new, after)
        s.cache.truncate(s.committed)

    @torch.no_grad()
    def _commit_features(self, s: _FSeq, feats: torch.Tensor, start: int) -> None:
        """Entries for feature rows at positions start.. (f_t with x_{t+1}); rows already committed,
        or whose next token is not final yet, are skipped."""
        first = max(start, s.next_pos)
        last = min(start + feats.shape[0], len(s.tokens) - 1)  # x_{t+1} must be known
        if last <= first:
            return
        rows = feats[first - start:last - start]
        dtype = self.head.fc.weight.dtype
        g = self.head.fuse(rows.to(dtype))  # [n, H]
        e = self._embed(torch.tensor(s.tokens[first + 1:last + 1])).to(dtype)  # [n, H]
        h = self.head.extend(s.cache, g, e, first)
        s.committed = len(s.cache)
        s.next_pos = last
        s.last_h = h[-1:]

    @torch.no_grad()
    def _draft(self, r: ProposeRequest, s: _FSeq) -> Proposal:
        if r.k <= 0 or s.last_h is None:
            return Proposal(r.seq_id, (), None)
        dtype = self.head.fc.weight.dtype
        # Tokens known past the last committed entry's prediction: fed as chain entries.
        forced = chain_tail(s.tokens, s.drafted, s.next_pos + 1)
        h, pos = s.last_h, s.next_pos
        for y in forced:
            h = self.head.extend(s.cache, h, self._embed(torch.tensor([y])).to(dtype), pos)
            pos += 1
        new: list[int] = []
        q_x: list[float] = []
        rows: list[torch.Tensor] = []
        leaves = r.tree_nodes if tree_eligible(s.params) and not r.pending_drafts and s.grammar is None else 0
        alternatives: list[tuple[float, int]] = []  # per draft: (top-1 probability, runner-up id)
        sure = 1.0  # product of the chain's top-1 probabilities (greedy)
        for j in range(r.k):
            mask = self._mask(s)
            if s.params.greedy:  # the argmax over the draft vocabulary is the one over all (q = 0 elsewhere)
                sub = self.head.logits(h)[0]  # [Vd]
                if mask is not None:  # the grammar's tokens of the draft vocabulary only
                    sub = sub.float().masked_fill(~self._allowed(mask), float("-inf"))
                    if not bool(torch.isfinite(sub).any()):
                        break  # nothing in the draft vocabulary continues the grammar: the chain ends
                t = int(self.head.draft_ids[greedy_ids(sub)])
                if leaves or (self.stop_below > 0 and r.k > 1):  # one draft: nothing to stop early
                    p1, alt = runner_up(sub)  # with a grammar: the masked distribution's (no leaves there)
                    sure *= p1
                    if j > 0 and sure < self.stop_below:
                        break  # unsure from here on: the verify row would rarely pay (SpecConfig.draft_stop)
                    alternatives.append((p1, int(self.head.draft_ids[alt])))
            elif mask is not None:  # sampled: q is the masked distribution over the whole vocabulary
                full = self._full_logits(h)
                apply_masks(full, mask)
                if not bool(torch.isfinite(full).any()):
                    break
                t = sample_drafts([s], [full], {0: q_x}, {0: rows}, [0])[0]
            else:
                t = sample_drafts([s], [self._full_logits(h)], {0: q_x}, {0: rows}, [0])[0]
            s.drafted.append(t)
            new.append(t)
            if j + 1 < r.k:
                h = self.head.extend(s.cache, h, self._embed(torch.tensor([t])).to(dtype), pos)
                pos += 1
        sampled = bool(rows)
        s.q_rows.extend(rows if sampled else [None] * len(new))
        # the chain (all the drafter keeps), plus runner-up leaves where it was unsure
        return chain_proposal(r.seq_id, new, q_x if sampled else None, alternatives if leaves else None, leaves)

    @staticmethod
    def _mask(s: _FSeq) -> torch.Tensor | None:
        """The bitmask [1, W] of the tokens the sequence's grammar allows after its output and chain;
        None: no grammar, or a chain the matcher refuses (unmasked: the verifier cuts)."""
        return None if s.grammar is None else s.grammar.mask(s.tokens[s.prompt_len:] + s.drafted)

    def _allowed(self, mask: torch.Tensor) -> torch.Tensor:
        """mask [1, W] int32, the grammar's bitmask (token i in bit i % 32 of word i // 32, as
        apply_masks reads it) -> [Vd] bool: the draft vocabulary's tokens it allows. A greedy draft
        needs only these, not the [V] logits apply_masks would mask."""
        ids = self.head.draft_ids
        return ((mask[0, ids // 32] >> (ids % 32)) & 1).bool()

    def _full_logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [1, H] -> [1, V] float32 logits, -inf outside the draft vocabulary (q = 0 there)."""
        sub = self.head.logits(h).float()  # [1, Vd]
        full = torch.full((1, self.vocab_size), float("-inf"))
        full[:, self.head.draft_ids] = sub
        return full

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:  # [n] -> [n, H]
        if isinstance(self.embedding, torch.Tensor):
            return F.embedding(ids, self.embedding)
        return self.embedding(ids)

    # ---- q rows ------------------------------------------------------------------------------------
    @property
    def num_q_rows(self) -> int:
        return sum(1 for s in self.seqs.values() for r in s.q_rows if r is not None)

    def fetch_rows(self, fetch: Sequence[RowRequest]) -> list[QRow]:
        return fetch_q_rows(self._get, fetch)


def base_model(name: str) -> str | None:
    """The model argument of the target an EAGLE-3 head (alias or directory) was trained for: its
    config.json's `specsplit_base_model` (None where it has none). The head drafts in that target's
    vocabulary, so a drafter service reads the target's embedding, tokenizer and config from it."""
    import json

    from specsplit.models.registry import resolve_model_path

    raw = json.loads((resolve_model_path(name) / "config.json").read_text())
    return raw.get("specsplit_base_model") or None


def load_feature_drafter(name: str, max_model_len: int, device: str | torch.device = "cpu",
                         dtype: torch.dtype = torch.float32, embedding: torch.Tensor | None = None,
                         num_target_layers: int | None = None) -> FeatureDrafter:
    """An EAGLE-3 head by alias or directory. embedding: the target's token embedding [V, H]
    (colocated: the loaded target's; None: read from the head's `specsplit_base_model`)."""
    from specsplit.models.eagle3 import load_eagle3
    from specsplit.models.registry import resolve_model_path

    path = resolve_model_path(name)
    if embedding is None:
        base = base_model(name)
        if not base:
            raise ValueError(f"{name}: an EAGLE-3 head needs its target's token embedding; run it colocated with the "
                             "target, or add \"specsplit_base_model\" (the target's model argument) to its config.json")
        embedding = base_embedding(base, device, dtype)
    lookup = None  # a GGUF target's quantized embedding module: looked up as is, dense only while loading
    if isinstance(embedding, torch.nn.Module):
        lookup, embedding = embedding, embedding.weight
    embedding = embedding.detach().to(device=device, dtype=dtype)
    head = load_eagle3(path, target_embedding=embedding, num_target_layers=num_target_layers, dtype=dtype, device=device)
    if head.cfg.vocab_size != embedding.shape[0] or head.cfg.hidden_size != embedding.shape[1]:
        raise ValueError(f"{name}: the head is for a vocabulary of {head.cfg.vocab_size} x hidden {head.cfg.hidden_size}; "
                         f"the target's embedding is {tuple(embedding.shape)}")
    if lookup is not None:
        embedding = lookup
    use_cpu_kernels(head)
    drafter = FeatureDrafter(head, embedding, max_model_len)
    log.info("feature drafter %s: EAGLE-3 head over target layers %s, draft vocabulary %d, %.1f MB of weights (%s)",
             name, drafter.feature_layers, head.draft_ids.numel(), tensor_storage_bytes(head) / 1e6, dtype)
    return drafter


def base_embedding(base: str, device: str | torch.device, dtype: torch.dtype) -> torch.Tensor | torch.nn.Module:
    """The target's token embedding for a head without its target in the process (a drafter
    service): a GGUF target's quantized rows as the file holds them where they run (a CPU, fp32;
    the colocated head shares the very same module with its target, so both look up the same
    numbers), else the dense [V, H] rows of its Hugging Face directory (a GGUF's dequantized one).
    The head only looks rows up in it; its draft-vocabulary head is built from it once."""
    from specsplit.models import gguf_native
    from specsplit.models.loader import TensorSource, hf_dir_for
    from specsplit.models.registry import resolve_model_path

    path = resolve_model_path(base)
    if path.suffix == ".gguf" and torch.device(device).type == "cpu" and dtype == torch.float32:
        rows = gguf_native.token_embedding(path)
        if rows is not None:
            return rows
    src = TensorSource(hf_dir_for(base, show_progress=False))
    try:
        return src.get("model.embed_tokens.weight")
    finally:
        src.close()


def embedding_bytes(embedding: torch.Tensor | torch.nn.Module) -> int:
    """Bytes behind a drafter's embedding (dense rows, or a quantized module's blocks)."""
    if isinstance(embedding, torch.nn.Module):
        return tensor_storage_bytes(embedding)
    return embedding.untyped_storage().nbytes()


def use_cpu_kernels(head: Eagle3Head) -> None:
    """On a CPU, run the head's matmuls (1-8 rows a call while drafting) with the kernels the target
    uses for those row counts (specsplit.models.cpu_linear: the skinny kernel on fp32 where it
    builds, oneDNN-packed for bf16), not MKL's slow small-M path. Same weights, same function."""
    from specsplit.models import cpu_linear
    from specsplit.models.llama import Linear

    kinds = cpu_linear.candidates(head.fc.weight.device, head.fc.weight.dtype, cpu_linear.policy())
    if not kinds:
        return
    table = cpu_linear.static_table(head.fc.weight.dtype, cpu_linear.SKINNY in kinds)

    untracked = []  # packed bytes each fast() Linear keeps (opaque to storage tracking)

    def fast(w: torch.Tensor) -> Linear:  # w [out, in]
        m = Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            m.weight.copy_(w)
        m.requires_grad_(False)
        m.make_copies(kinds)
        untracked.append(m.keep(table))
        return m

    quantize_layer = os.environ.get("SPECSPLIT_DRAFT_Q8", "1") != "0"

    def pick(w: torch.Tensor) -> torch.nn.Module:
        return (quantized(w) if quantize_layer else None) or fast(w)

    layer = head.midlayer
    head.fc = pick(head.fc.weight)
    for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
        setattr(layer, name, pick(getattr(layer, name).weight))
    quant = quantized(head.lm_head)
    if quant is not None:
        head.head_linear, head.lm_head = quant, None  # the blocks hold it now
    else:
        head.head_linear = fast(head.lm_head)
    head.untracked_weight_bytes = sum(untracked)  # tensor_storage_bytes and the memory plan add it
    int8_linear.into_huge_pages([m for m in (head.fc, layer.qkv_proj, layer.o_proj, layer.gate_up_proj,
                                             layer.down_proj, head.head_linear) if isinstance(m, Int8Linear)])
    log.info("EAGLE-3 head on the CPU kernels: lm head %s, layer %s", linear_kind(head.head_linear),
             linear_kind(layer.qkv_proj))


def linear_kind(m: torch.nn.Module) -> str:
    """How a head's linear multiplies (the log's words)."""
    from specsplit.kernels import quant_linear

    if isinstance(m, Int8Linear):
        return "Q8_0 x int8 activations (%s)" % ("AVX-512 VNNI" if quant_linear.uses_vnni() else "AVX2")
    return "Q8_0" if getattr(m, "quant", None) is not None else "fp32"


def quantized(w: torch.Tensor) -> torch.nn.Module | None:
    """w [out, in] as Q8_0 blocks, or None (not fp32 on a CPU, `in` not a multiple of 32, or no
    kernel).

    The lm head is most of a drafted token's bytes (8,192 rows x 576: 18.9 MB fp32, 5.0 MB as
    Q8_0); a GGUF target's embedding is Q8_0 already, and its dequantized rows quantize back to the
    very same blocks, so those logits are the same numbers. The layer's weights (fc, q|k|v, o,
    gate|up, down: 5.1M weights, 20 MB fp32) go to Q8_0 too (SPECSPLIT_DRAFT_Q8=0 keeps them fp32):
    a drafter's numbers decide only which tokens are proposed, never which are kept (the target
    verifies every one), so its precision costs acceptance at most, measured in
    docs/feature-drafter.md.

    For the same reason the activations are rounded to int8 too (models/int8_linear.Int8Linear:
    ~3x faster than the fp32 loop over the same blocks with AVX-512 VNNI, ~2x with AVX2, measured
    in docs/feature-drafter.md; on the AMX Xeon 1.4-5x faster than the tile loop over the same
    blocks, docs/kernels.md "The AMX Xeon again"), unless SPECSPLIT_DRAFT_INT8=0. The int8 loops
    give the same numbers on every CPU, so a drafter drafts the same tokens everywhere."""
    from specsplit.kernels import quant_linear
    from specsplit.models.llama import Linear

    if (w.device.type != "cpu" or w.dtype != torch.float32 or w.shape[1] % quant_linear.BLOCK
            or quant_linear.load() is None):
        return None
    blocks = quant_linear.quantize_q8_0(w)
    if os.environ.get(ENV_INT8, "1") != "0":
        return Int8Linear(blocks)
    m = Linear(w.shape[1], w.shape[0], bias=False, dtype=torch.float32)
    m.set_quant(quant_linear.for_kernel(blocks))  # AMX tiles where that loop runs
    m.requires_grad_(False)
    return m


DRAFT_ROUNDS = 9  # interleaved rounds of the head's calibration (a round of every batch size takes ~40 ms)


def calibrate_feature_drafter(drafter: FeatureDrafter, max_batch: int, context: int = 64, rounds: int = DRAFT_ROUNDS):
    """StepCosts.draft[b]: seconds to draft one token for b sequences (each step also commits two
    feature rows, as a step that accepted one draft does).

    As the verifier's calibration (calibration._measure): no single sample is trusted. Every batch
    size has its own sequences, each is timed once per round over `rounds` interleaved rounds (the
    order rotated each round, one warm-up round dropped), the estimate is the median, the table is
    made non-decreasing in the batch and the log gives the spread. A call takes about half a
    millisecond, and this VM drifts over seconds (the same call 0.50 to 0.94 ms in one process), so
    start-ups still differ (four read 0.5 to 0.8 ms at one sequence; docs/feature-drafter.md); what
    interleaving buys is batch sizes timed in the same moments and a median of 9 samples, not 3.
    Rounds are fewer where max_model_len leaves no room for them (each call adds two tokens)."""
    import time

    from specsplit.calibration import BATCH_SIZES, StepCosts, Timings, isotonic

    costs = StepCosts()
    rounds = min(rounds, (drafter.max_model_len - context - 2) // 2 - 1)
    batches = [b for b in BATCH_SIZES if b <= max(1, max_batch)]
    if rounds < 1 or not batches:
        return costs
    F_ = drafter.feature_size
    n_tok = context + 2 * (rounds + 1)
    gen = torch.Generator().manual_seed(0)
    toks = [(7 * j + 3) % drafter.vocab_size for j in range(n_tok)]
    feats = torch.randn(n_tok, F_, generator=gen)  # [n_tok, F] random target features
    ids = {b: [f"__calibrate_{b}_{i}__" for i in range(b)] for b in batches}
    timings = Timings({(b, 1): [] for b in batches})
    t_all = time.perf_counter()
    added: list[str] = []
    try:
        for b in batches:
            drafter.add([SeqAdd(s, tuple(toks[:context])) for s in ids[b]])
            added += ids[b]
            drafter.propose([ProposeRequest(s, (), 0, features=feats[:context - 1], features_start=0) for s in ids[b]])
        n = context  # every sequence is at the same length after each round
        for rnd in range(rounds + 1):
            order = batches[rnd % len(batches):] + batches[:rnd % len(batches)]
            for b in order:
                t0 = time.perf_counter()
                drafter.propose([ProposeRequest(s, tuple(toks[n:n + 2]), 1, features=feats[n - 1:n + 1],
                                                features_start=n - 1) for s in ids[b]])
                if rnd > 0:
                    timings.samples[(b, 1)].append(time.perf_counter() - t0)
            n += 2
    finally:
        drafter.release(added)
    med = timings.medians()
    costs.draft = dict(zip(batches, isotonic([med[(b, 1)] for b in batches])))  # never cheaper for more sequences
    costs.spread = timings.spread()
    log.info("feature drafter calibration (%.1fs, %d interleaved rounds, spread %.0f%%): %s",
             time.perf_counter() - t_all, rounds, 100 * costs.spread, costs.describe())
    return costs
