"""DraftEngine and TargetEngine: sequences in, tokens out, KV kept and rolled back.

Both implement the protocols in specsplit.protocols in-process; the gRPC servicers are thin
wrappers over them. Per sequence they keep only its tokens, how many are in the KV cache and its
random numbers (keyed by position: specsplit.sampling.rng). The drafter also keeps its chain of
drafts past the final tokens, with the q row of each sampled draft, until the next propose moves
past it (at most K, or K + 1 + K while the gateway pre-drafts); the verifier keeps the p row of a
pending rejection until resolve. Nothing else survives a step.
"""
from __future__ import annotations

import logging
import re
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Mapping, Sequence

import torch

from specsplit.draft_tree import DraftTree, chain_with_leaves, parents_problem, runner_up, tree_eligible
from specsplit.kv.block_manager import OutOfBlocks
from specsplit.models.runner import ForwardItem, ModelRunner
from specsplit.protocols import (
    DrafterTraits,
    Proposal,
    ProposeRequest,
    QRow,
    RowRequest,
    SeqAdd,
    VerifierTraits,
    VerifyRequest,
    VerifyResult,
)
from specsplit.sampling.coupled import coupled_sample
from specsplit.sampling.grammar import GrammarCompiler, GrammarError, GrammarState, apply_masks
from specsplit.sampling.logprobs import MAX_LOGPROBS, PROMPT_LOGITS_ROWS, TokenLogprob, seq_logprobs, token_logprobs
from specsplit.sampling.ngram import ngram_branches, ngram_propose
from specsplit.sampling.params import SamplingParams
from specsplit.sampling.penalties import penalize
from specsplit.sampling.probs import greedy_ids, logits_to_probs, sampling_tensors
from specsplit.sampling.rejection import RejectionSampler, matched_prefix
from specsplit.sampling.rng import SeqRandom
from specsplit.sampling.sample import sample_from_probs

log = logging.getLogger(__name__)


class EngineError(ValueError):
    """A request the engine refuses (unknown sequence, bad ids, too long); nothing was changed.
    One about a single sequence names it first: "sequence '<seq_id>': ..." or "unknown sequence
    '<seq_id>' ..." (culprit() reads it back, over the wire too)."""


_CULPRIT = re.compile(r"^(?:unknown )?sequence '([^']+)'[: ]")


def culprit(message: str) -> str | None:
    """The sequence an engine's refusal names first ("sequence 'r7': ...", "unknown sequence 'r7'
    on the verifier ..."), or None."""
    m = _CULPRIT.match(message)
    return m.group(1) if m else None


@dataclass
class _Seq:
    tokens: list[int]  # prompt + every token this side knows to be final
    params: SamplingParams
    rng: SeqRandom
    num_computed: int = 0  # leading tokens (plus, on the drafter, drafts) whose KV is cached
    drafted: list[int] = field(default_factory=list)  # drafter: the chain of drafts past `tokens`
    q_rows: list = field(default_factory=list)  # drafter: per chain draft, its [V] q row (sampled) or None
    p_row: torch.Tensor | None = None  # verifier, pending: [V] p at the first rejection
    pending_accepted: int = 0  # verifier, pending: accepted drafts awaiting the recovered token
    pending_drafts: list[int] = field(default_factory=list)  # verifier, pending: those drafts
    pending_u: float = 0.0  # verifier, pending: the step's final uniform
    undo: tuple[int, int] | None = None  # verifier: (len(tokens), num_computed) before the last verify
    logprobs: int | None = None  # verifier: alternatives per emitted token (None: no logprobs)
    pending_logits: torch.Tensor | None = None  # verifier, pending + logprobs: [n+1, V] target logits
    feature_layers: tuple[int, ...] = ()  # verifier: layers to return fused features of (SeqAdd)
    step_features: torch.Tensor | None = None  # verifier: [rows, F] of the last verify, from its start
    prompt_len: int = 0  # tokens[:prompt_len] is the prompt, the rest generated (penalties, grammar)
    grammar: GrammarState | DraftGrammar | None = None  # verifier: the sequence's matcher; drafter: DraftGrammar
    prompt_logprobs: int | None = None  # verifier: alternatives per prompt position, until its first verify
    prompt_scored: list = field(default_factory=list)  # verifier: TokenLogprobs of prompt pieces computed so far

    @property
    def num_generated(self) -> int:
        """Generated tokens before the next position scored: past the prompt, plus (drafter) the
        chain's drafts. What min_tokens is counted against (SamplingParams.processed_at)."""
        return len(self.tokens) - self.prompt_len + len(self.drafted)


def _probs(logits: list[torch.Tensor], params: Sequence[SamplingParams]) -> list[torch.Tensor]:
    """Per-sequence logits [n_i, V] -> probabilities [n_i, V] under each request's transform."""
    rows = [x.shape[0] for x in logits]
    t, k, p, m = sampling_tensors(params, rows, device=logits[0].device)
    return list(logits_to_probs(torch.cat(logits), t, k, p, m).split(rows))


def sample_drafts(seqs, logits: list[torch.Tensor], q_x: dict, rows: dict, live: list[int]) -> list[int]:
    """Draw one draft per sequence from its logits [1, V] (a drafter's; -inf = q 0 there).

    seqs: each with .params, .rng, .tokens and .drafted (the draft lands at position
    len(tokens) + len(drafted), which keys its random numbers). Greedy: argmax; coupled (seeded):
    the shared-noise argmax, no q needed; otherwise sampled, with q(x) appended to q_x[i] and the
    [V] q row to rows[i] for i in live (the verifier's rejection sampler needs both).
    """
    tokens: list[int] = []
    probs = None
    if any(not s.params.greedy for s in seqs):
        probs = _probs(logits, [s.params for s in seqs])
    for j, (s, i) in enumerate(zip(seqs, live)):
        if s.params.greedy:
            tokens.append(int(greedy_ids(logits[j][0])))
            continue
        row = probs[j][0]  # [V]
        if s.params.coupled:  # x_j = argmax(log q_j + g_j): no q(x), no q rows needed
            tokens.append(coupled_sample(row, s.params.seed, len(s.tokens) + len(s.drafted)))
            continue
        u = s.rng.uniforms(len(s.tokens) + len(s.drafted), 1, "draft")  # this draft's position
        t = int(sample_from_probs(row[None], u)[0])
        tokens.append(t)
        q_x[i].append(float(row[t]))
        rows[i].append(row)
    return tokens


def _feature_layers(seqs: Sequence[_Seq]) -> tuple[int, ...]:
    """The layers one verify captures: the union of its sequences' (in the order first asked)."""
    out: list[int] = []
    for s in seqs:
        out.extend(i for i in s.feature_layers if i not in out)
    return tuple(out)


def _features_for(s: _Seq, layers: tuple[int, ...], fused: torch.Tensor) -> torch.Tensor | None:
    """This sequence's columns of a forward's fused features [rows, len(layers) * H]."""
    if not s.feature_layers:
        return None
    if tuple(s.feature_layers) == layers:
        return fused
    h = fused.shape[1] // len(layers)
    return torch.cat([fused[:, layers.index(i) * h:(layers.index(i) + 1) * h] for i in s.feature_layers], dim=1)


def check_token_ids(seq_id: str, ids: Sequence[int], vocab_size: int | None) -> None:
    if vocab_size is None:  # a lookup drafter started without the target's vocabulary
        return
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise EngineError(f"sequence {seq_id!r}: token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")


def check_seq_adds(seqs: Sequence[SeqAdd], running, side: str, vocab_size: int | None,
                   max_model_len: int | None) -> None:
    """What every engine refuses in an add, before it allocates anything (all or nothing): an id
    already running or given twice, an empty prompt or one that leaves no room under
    max_model_len, ids outside the vocabulary (None: unchecked), bad sampling params or logprobs."""
    seen: set[str] = set()
    for s in seqs:
        if s.seq_id in running or s.seq_id in seen:
            raise EngineError(f"sequence {s.seq_id!r} is already running on the {side}")
        seen.add(s.seq_id)
        if not s.prompt_token_ids:
            raise EngineError(f"sequence {s.seq_id!r} has an empty prompt")
        if max_model_len is not None and len(s.prompt_token_ids) >= max_model_len:
            raise EngineError(f"sequence {s.seq_id!r}: prompt of {len(s.prompt_token_ids)} tokens leaves no room "
                              f"under max_model_len {max_model_len}")
        if vocab_size is not None:
            check_token_ids(s.seq_id, s.prompt_token_ids, vocab_size)
        try:
            s.params.validate()
        except ValueError as e:
            raise EngineError(f"sequence {s.seq_id!r}: {e}") from None
        if not 0 <= s.generated <= len(s.prompt_token_ids):
            raise EngineError(f"sequence {s.seq_id!r}: generated must be in [0, {len(s.prompt_token_ids)}], "
                              f"got {s.generated}")
        if s.logprobs is not None and not 0 <= s.logprobs <= MAX_LOGPROBS:
            raise EngineError(f"sequence {s.seq_id!r}: logprobs must be in [0, {MAX_LOGPROBS}], got {s.logprobs}")
        if s.prompt_logprobs is not None and not 0 <= s.prompt_logprobs <= MAX_LOGPROBS:
            raise EngineError(f"sequence {s.seq_id!r}: prompt_logprobs must be in [0, {MAX_LOGPROBS}], "
                              f"got {s.prompt_logprobs}")


def prefill_chunks(reqs: Sequence[VerifyRequest], seqs: Sequence[_Seq]) -> dict[int, int]:
    """Chunked prefill: index -> n for each request whose prefill_tokens leaves part of its
    uncached tokens for a later step (it computes n of them and emits nothing). A request whose
    limit covers the rest is an ordinary step. EngineError for a piece with drafts."""
    out = {}
    for i, (r, s) in enumerate(zip(reqs, seqs)):
        if 0 < r.prefill_tokens < len(s.tokens) - s.num_computed:
            if r.draft_token_ids:
                raise EngineError(f"sequence {r.seq_id!r}: a prompt piece ({r.prefill_tokens} of its "
                                  f"{len(s.tokens) - s.num_computed} uncached tokens) cannot verify drafts")
            out[i] = r.prefill_tokens
    return out


def check_propose(r: ProposeRequest, s, vocab_size: int | None, max_model_len: int) -> None:
    """What every drafter refuses in a propose: bad ids, k < 0, or a chain past max_model_len
    (the context plus k - 1 drafts: the last draft is never fed)."""
    check_token_ids(r.seq_id, tuple(r.new_token_ids) + tuple(r.pending_drafts), vocab_size)
    if r.k < 0:
        raise EngineError(f"sequence {r.seq_id!r}: k must be >= 0, got {r.k}")
    if len(s.tokens) + len(r.new_token_ids) + len(r.pending_drafts) + max(r.k - 1, 0) > max_model_len:
        raise EngineError(f"sequence {r.seq_id!r}: drafting {r.k} tokens passes max_model_len {max_model_len}")


def ingest_chain(s, new: Sequence[int], pending: Sequence[int] = ()) -> int:
    """A drafter's sequence `s` (.tokens, .drafted, .q_rows) takes the tokens emitted since the last
    call (final) and the drafts being verified now (`pending`, not final): the chain of drafts becomes
    `pending`. q rows are kept for the part of the old chain they confirm, so a pre-drafted branch
    that came true costs nothing. Returns how many old drafts were confirmed (its KV stays valid)."""
    matched = matched_prefix(s.drafted, list(new) + list(pending))
    keep = max(0, matched - len(new))  # drafts of `pending` whose q rows are still the old chain's
    rows = s.q_rows[len(new):len(new) + keep]
    s.tokens.extend(new)
    s.drafted = list(pending)
    s.q_rows = rows + [None] * (len(pending) - keep)
    return matched


def chain_proposal(seq_id: str, new: Sequence[int], q_x: Sequence[float] | None,
                   alternatives: Sequence[tuple[float, int]] | None, tree_nodes: int) -> Proposal:
    """What a model drafter proposes after drafting the chain `new`: the chain with each sampled
    draft's q(x) (q_x None: greedy), or, where it collected `alternatives` (per draft: top-1
    probability, runner-up id) for a tree, the chain plus runner-up leaves
    (draft_tree.chain_with_leaves). Leaves are proposed, never kept: no KV, no q rows."""
    if alternatives is not None:
        tree = chain_with_leaves(new, alternatives, tree_nodes)
        if not tree.is_chain:
            return Proposal(seq_id, tree.tokens, None, tree.parents)
    return Proposal(seq_id, tuple(new), tuple(q_x) if q_x is not None else None)


class DraftGrammar:
    """A drafter's matcher for one sequence's grammar, best effort and never waited for.

    A drafter answers within the step's deadline (a remote one: about a verify's time), and a
    grammar's first compile takes far longer (the tokenizer's table on the first one, then each
    new schema: tens of ms to seconds). So the compile runs on the compiler's threads and the
    sequence drafts unmasked until it is done; from then on its drafts are masked (the matcher
    takes the output so far at its first mask). A grammar that does not compile here, or a chain
    the matcher refuses (a lookup's drafts), is drafted unmasked: the verifier cuts."""

    def __init__(self, grammars: GrammarCompiler, seq_id: str, params: SamplingParams):
        self.seq_id = seq_id
        self.vocab_size = grammars.vocab_size
        self.state: GrammarState | None = None
        self.pending: Future | None = grammars.submit(params.grammar)

    def _ready(self) -> GrammarState | None:
        if self.state is None and self.pending is not None and self.pending.done():
            future, self.pending = self.pending, None
            try:
                self.state = GrammarState(future.result(), self.vocab_size)
            except Exception as e:  # noqa: BLE001 - GrammarError, or a tokenizer that does not load here
                log.info("drafter: sequence %r drafts without its grammar's mask: %s", self.seq_id, e)
        return self.state

    def mask(self, generated: Sequence[int]) -> torch.Tensor | None:
        """The bitmask [1, W] of the tokens the grammar allows after `generated` (the output and the
        chain so far); None: not compiled (yet), or a chain the matcher refuses."""
        state = self._ready()
        if state is None:
            return None
        try:
            state.sync(generated)
            return state.masks(())[1]
        except GrammarError:
            return None


def draft_grammar(grammars: GrammarCompiler | None, seq_id: str, params: SamplingParams) -> DraftGrammar | None:
    """A drafter's matcher for a request's grammar (DraftGrammar; None without a compiler or a grammar)."""
    if grammars is None or params.grammar is None:
        return None
    return DraftGrammar(grammars, seq_id, params)


def chain_tail(tokens: list[int], drafted: list[int], start: int) -> list[int]:
    """(tokens + drafted)[start:], a drafter's context past `start`, without copying what comes
    before it (the concatenation copied the whole context for every drafted token)."""
    return drafted[start - len(tokens):] if start >= len(tokens) else tokens[start:] + drafted


def draft_mask(grammar: DraftGrammar | None, generated: Sequence[int]) -> torch.Tensor | None:
    """DraftGrammar.mask (None: no grammar; drafted unmasked this time)."""
    return None if grammar is None else grammar.mask(generated)


def fetch_q_rows(get, fetch: Sequence[RowRequest]) -> list[QRow]:
    """The requested q rows (get: seq_id -> the drafter's sequence): position j is the j-th draft
    past the sequence's final tokens. Nothing is dropped here: a sampled draft's q row lives with
    the chain and goes at the next propose that moves past it, or at release."""
    out = []
    for r in fetch:
        s = get(r.seq_id)
        row = s.q_rows[r.position] if 0 <= r.position < len(s.q_rows) else None
        if row is None:
            raise EngineError(f"sequence {r.seq_id!r} has no q row at draft position {r.position}")
        out.append(QRow(r.seq_id, row.clone()))
    return out


class _EngineBase:
    side = "engine"

    def __init__(self, runner: ModelRunner, max_prefill_tokens: int = 512):
        self.runner = runner
        self.max_prefill_tokens = max_prefill_tokens
        self.seqs: dict[str, _Seq] = {}
        self.step_costs = None  # calibration.StepCosts, timed at start-up when the K policy is on

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    @property
    def num_running(self) -> int:
        return len(self.seqs)

    @property
    def block_manager(self):
        return self.runner.block_manager

    def _check_ids(self, seq_id: str, ids: Sequence[int]) -> None:
        check_token_ids(seq_id, ids, self.vocab_size)

    def _get(self, seq_id: str) -> _Seq:
        try:
            return self.seqs[seq_id]
        except KeyError:
            raise EngineError(f"unknown sequence {seq_id!r} on the {self.side}: add it first") from None

    def add(self, seqs: Sequence[SeqAdd]) -> None:
        """Register sequences and reserve KV for their prompts; all or nothing."""
        check_seq_adds(seqs, self.seqs, self.side, self.vocab_size, self.runner.max_model_len)
        added: list[str] = []
        try:
            for s in seqs:
                # With prefix caching, the KV of a cached prefix is there already (kv/block_manager.py)
                cached = self.block_manager.allocate(s.seq_id, len(s.prompt_token_ids),
                                                     s.prompt_token_ids if self._reuses_prefix(s) else None)
                added.append(s.seq_id)
                self.seqs[s.seq_id] = _Seq(
                    tokens=list(s.prompt_token_ids), params=s.params, rng=SeqRandom(s.params.seed, self.side),
                    num_computed=cached, logprobs=s.logprobs, feature_layers=tuple(s.feature_layers),
                    prompt_len=len(s.prompt_token_ids) - s.generated,
                )
        except OutOfBlocks:
            self.release(added)
            raise

    def _reuses_prefix(self, s: SeqAdd) -> bool:
        """Whether the sequence takes a cached prefix's KV (prefix caching) instead of computing it."""
        return True

    def release(self, seq_ids: Sequence[str], finished: bool = False) -> None:
        for seq_id in seq_ids:
            s = self.seqs.pop(seq_id, None)
            if s is not None and self.block_manager.has(seq_id):
                # Nothing rolls back now: the prefix computed so far (not drafts) stays reusable
                self.block_manager.cache_prefix(seq_id, s.tokens, min(s.num_computed, len(s.tokens)))
            self.runner.free(seq_id)

    def _keep_reserved(self, seq_id: str, s: _Seq) -> None:
        """After a prompt piece: the forward cut the sequence's blocks to what it computed; take the
        rest of its prompt's blocks back (add reserved them), so a later piece cannot run out."""
        self.block_manager.grow_to(seq_id, len(s.tokens))

    def _forward(self, items: list[ForwardItem], features: tuple[int, ...] = (),
                 out_features: list | None = None, greedy: bool = False) -> list[torch.Tensor]:
        """runner.forward with long inputs (prompts) split into chunks of max_prefill_tokens.
        features/out_features: as ModelRunner.forward (whole items' rows, chunks joined).
        greedy: each item's greedy ids [num_logits] instead of its logits (ModelRunner.forward)."""
        more = {"greedy": True} if greedy else {}  # (a profiling runner takes no such argument)
        chunk = self.max_prefill_tokens
        items = list(items)
        heads: dict[int, list[torch.Tensor]] = {}  # rows of the chunks already run, per item
        while True:
            # The last piece keeps every wanted logit (a resumed or long prompt plus k drafts).
            cut = {i: min(chunk, len(it.token_ids) - it.num_logits) for i, it in enumerate(items)
                   if len(it.token_ids) > chunk}
            long = [i for i, c in cut.items() if c > 0]
            if not long:
                break
            head = [ForwardItem(items[i].seq_id, items[i].start, items[i].token_ids[:cut[i]], 1) for i in long]
            if features:
                got: list = []
                self.runner.forward(head, features, got)
                for i, f in zip(long, got):
                    heads.setdefault(i, []).append(f)
            else:
                self.runner.forward(head)
            for i in long:
                it, c = items[i], cut[i]
                items[i] = replace(it, start=it.start + c, token_ids=it.token_ids[c:])
        if not features:
            return self.runner.forward(items, **more)
        got = []
        logits = self.runner.forward(items, features, got, **more)
        out_features.extend(torch.cat(heads.get(i, []) + [f]) for i, f in enumerate(got))
        return logits


class TargetEngine(_EngineBase, VerifierTraits):
    """The target model: scores k drafts + 1 in one forward and applies the rejection sampler."""

    side = "verifier"

    def __init__(self, runner: ModelRunner, max_prefill_tokens: int = 512, sampler: RejectionSampler | None = None,
                 grammars: GrammarCompiler | None = None):
        super().__init__(runner, max_prefill_tokens)
        self.sampler = sampler or RejectionSampler()
        # Compiles the grammars of structured-output requests (None: they are refused). The
        # builders set it from the target's tokenizer; colocated, the gateway admits with it too.
        self.grammars = grammars
        # One rank of a tensor-parallel group (specsplit.parallel.group sets it when it builds the
        # group): the verifier servicer watches it and reports a dead worker. None: one process.
        self.tensor_parallel = None

    def _reuses_prefix(self, s: SeqAdd) -> bool:
        # a sequence that scores its prompt (prompt_logprobs) needs every prompt position's logits:
        # it computes the whole prompt itself, never writing into blocks other sequences share
        return s.prompt_logprobs is None

    def add(self, seqs: Sequence[SeqAdd]) -> None:
        """As _EngineBase.add; a sequence with a grammar gets its matcher (compiled, or cached),
        which takes the tokens a resumed sequence generated before. All or nothing."""
        states: dict[str, GrammarState] = {}
        for s in seqs:
            g = s.params.grammar
            if g is None:
                continue
            if self.grammars is None:
                raise EngineError(f"sequence {s.seq_id!r} has a grammar, but this verifier has no grammar "
                                  f"compiler (no tokenizer): structured output is unavailable")
            try:
                st = self.grammars.state(g)
                st.sync(s.prompt_token_ids[len(s.prompt_token_ids) - s.generated:] if s.generated else ())
            except GrammarError as e:
                raise EngineError(f"sequence {s.seq_id!r}: {e}") from None
            states[s.seq_id] = st
        super().add(seqs)
        for seq_id, st in states.items():
            self.seqs[seq_id].grammar = st
        for a in seqs:
            self.seqs[a.seq_id].prompt_logprobs = a.prompt_logprobs

    def _constrain(self, reqs: Sequence[VerifyRequest], seqs: Sequence[_Seq]) -> tuple[list[VerifyRequest], dict]:
        """Drafts cut where a sequence's grammar refuses one (specsplit.sampling.grammar), and each
        constrained sequence's row masks by index. Greedy / coupled sequences drop the refused draft
        (the masked target never picks it); sampled ones keep it, surely rejected (p = 0 there), so
        the token at its position comes from the residual max(0, p - q) as rejection sampling needs."""
        out, masks = list(reqs), {}
        for i, (r, s) in enumerate(zip(reqs, seqs)):
            if s.grammar is None:
                continue
            try:
                s.grammar.sync(s.tokens[s.prompt_len:])
            except GrammarError as e:
                raise EngineError(f"sequence {r.seq_id!r}: {e}") from None
            c, bitmask = s.grammar.masks(r.draft_token_ids)
            if c < len(r.draft_token_ids):
                keep = c if s.params.accepts_by_match else c + 1
                out[i] = replace(r, draft_token_ids=tuple(r.draft_token_ids[:keep]),
                                 draft_probs=None if r.draft_probs is None else tuple(r.draft_probs[:keep]))
            masks[i] = bitmask
        return out, masks

    def _process(self, logits: list[torch.Tensor], reqs: Sequence[VerifyRequest], seqs: Sequence[_Seq],
                 masks: dict) -> list[torch.Tensor]:
        """The logits the sampler reads: penalties and logit_bias (specsplit.sampling.penalties),
        then the grammar's masks, for the sequences that have them; the others' rows as they are.
        (Log-probabilities are of the raw logits.)"""
        out = list(logits)
        for i, (r, s) in enumerate(zip(reqs, seqs)):
            if not s.params.processed_at(s.num_generated):
                continue
            rows = penalize(logits[i], s.params, s.tokens[:s.prompt_len], s.tokens[s.prompt_len:],
                            r.draft_token_ids) if s.params.penalized_at(s.num_generated) else logits[i].float().clone()
            if i in masks:
                apply_masks(rows, masks[i])
            out[i] = rows
        return out

    def verify(self, reqs: Sequence[VerifyRequest]) -> list[VerifyResult]:
        if not reqs:
            return []
        seqs = [self._get(r.seq_id) for r in reqs]
        for r, s in zip(reqs, seqs):
            self._check_ids(r.seq_id, r.draft_token_ids)
            if s.p_row is not None:
                raise EngineError(f"sequence {r.seq_id!r} is waiting for resolve(), not verify()")
            if not s.params.accepts_by_match and r.draft_token_ids and (
                r.draft_probs is None or len(r.draft_probs) != len(r.draft_token_ids)
            ):
                raise EngineError(f"sequence {r.seq_id!r} samples, so it needs q(x) for each draft token")
            if r.draft_parents is not None:
                why = parents_problem(r.draft_parents, len(r.draft_token_ids))
                if why is not None:
                    raise EngineError(f"sequence {r.seq_id!r}: bad draft tree: {why}")
                if not tree_eligible(s.params):
                    raise EngineError(f"sequence {r.seq_id!r}: only greedy sequences with unprocessed logits "
                                      f"are verified as trees; send its drafts as a chain")
            if len(s.tokens) + len(r.draft_token_ids) > self.runner.max_model_len:  # KV positions needed
                raise EngineError(
                    f"sequence {r.seq_id!r}: {len(s.tokens)} tokens + {len(r.draft_token_ids)} drafts "
                    f"pass max_model_len {self.runner.max_model_len}"
                )
        chunks = prefill_chunks(reqs, seqs)  # index -> tokens of a prompt piece that emits nothing
        for r, s in zip(reqs, seqs):  # what earlier steps computed is final now: later prompts may reuse it
            self.block_manager.cache_prefix(r.seq_id, s.tokens, s.num_computed)
        reqs, masks = self._constrain(reqs, seqs)
        trees = {i: DraftTree(r.draft_token_ids, r.draft_parents) for i, r in enumerate(reqs)
                 if r.draft_parents is not None and r.draft_token_ids}
        trees = {i: t for i, t in trees.items() if not t.is_chain}  # a chain is verified as one
        if trees and self.tensor_parallel is not None:  # the workers' KV cannot move a path: chains
            for i, t in trees.items():
                m, probs = t.main_chain, reqs[i].draft_probs
                reqs[i] = replace(reqs[i], draft_token_ids=t.tokens[:m], draft_parents=None,
                                  draft_probs=None if probs is None else probs[:m])
            trees = {}
        prompt_lps, at, prompt_feats = self._score_prompts(reqs, seqs, chunks)
        items = [
            ForwardItem(r.seq_id, at.get(i, s.num_computed), s.tokens[at.get(i, s.num_computed) : s.num_computed + chunks[i]], 1)
            if i in chunks
            else ForwardItem(r.seq_id, at.get(i, s.num_computed), s.tokens[at.get(i, s.num_computed):] + list(r.draft_token_ids),
                             len(r.draft_token_ids) + 1, tree=trees[i].parents if i in trees else None)
            for i, (r, s) in enumerate(zip(reqs, seqs))
        ]
        layers = _feature_layers(seqs)
        feats: list = []
        # Only greedy ids asked of every row (plain greedy chains, no logprobs): the forward gives
        # the ids (the head's greedy copy skips most logits), else the logits
        ids_only = all((i in chunks and i not in prompt_lps) or (
            i not in chunks and s.params.greedy and not s.params.processed_at(s.num_generated) and s.logprobs is None
            and i not in prompt_lps) for i, s in enumerate(seqs))
        logits = self._forward(items, layers, feats, greedy=ids_only)  # per seq [k+1, V] or [k+1] ids ([1, ...] for a chunk); feats per seq [rows, F]
        for i, s in enumerate(seqs):
            s.undo = (len(s.tokens), s.num_computed)
            s.step_features = _features_for(s, layers, feats[i]) if layers else None
            if i in prompt_feats:  # the scored prompt positions come first
                s.step_features = torch.cat([prompt_feats[i], s.step_features])

        results: list[VerifyResult | None] = [None] * len(reqs)
        for i, n in chunks.items():
            if i in prompt_lps:
                self._score_piece_end(seqs[i], logits[i])
            results[i] = self._prefilled(reqs[i].seq_id, seqs[i], n)
        # Greedy and coupled (seeded, specsplit.sampling.coupled) sequences accept while the draft
        # equals the target's own choice; the others run the rejection sampler.
        greedy = [i for i, s in enumerate(seqs) if s.params.accepts_by_match and i not in trees and i not in chunks]
        if ids_only:
            for i, tree in trees.items():
                self._verify_tree(reqs[i].seq_id, seqs[i], tree, logits[i].tolist(), results, i)
            self._accept_greedy(greedy, reqs, seqs, [logits[i].tolist() for i in greedy], results)
            return results  # type: ignore[return-value]
        raw, logits = logits, self._process(logits, reqs, seqs, masks)
        sampled = [i for i, s in enumerate(seqs) if not s.params.accepts_by_match and i not in chunks]
        for i, tree in trees.items():
            raw[i] = raw[i][self._verify_tree(reqs[i].seq_id, seqs[i], tree, greedy_ids(logits[i]).tolist(), results, i)]
        if greedy:
            self._accept_greedy(greedy, reqs, seqs, self._targets(greedy, seqs, logits), results)
        if sampled:
            self._verify_sampled(sampled, reqs, seqs, logits, results)
        asked = [i for i, s in enumerate(seqs) if s.logprobs is not None and i not in chunks]
        if asked:
            self._add_logprobs(asked, seqs, raw, results)
        for i, lps in prompt_lps.items():
            if i in chunks:
                continue  # the rest of the prompt comes with a later piece
            seqs[i].prompt_logprobs, seqs[i].prompt_scored = None, []  # scored once: this verify's result carries them
            results[i] = replace(results[i], prompt_logprobs=lps)
        return results  # type: ignore[return-value]

    def _score_prompts(self, reqs: Sequence[VerifyRequest], seqs: Sequence[_Seq], chunks: Mapping[int, int]):
        """The prompt log-probabilities of the sequences that asked (SeqAdd.prompt_logprobs), scored
        as their prompt is computed: this step's positions from num_computed up to the one before
        the step's own forward run here with every logit row kept, PROMPT_LOGITS_ROWS positions per
        forward; row j's log_softmax scores prompt[j + 1] (the raw logits, as `logprobs`). The step's
        forward then computes the rest: the last position of a prompt piece (chunked prefill: its
        row scores the next prompt token, in _score_piece_end), or, at the last piece, the last
        prompt token and the drafts. Positions an earlier piece computed are never recomputed: they
        may be in the prefix cache by now. num_computed is not moved (the verify commits as usual; a
        failed one scores the same positions again, over what it scored before).

        Returns, by index in seqs: the TokenLogprobs (at the last piece: all len(prompt) - 1), where
        the step's forward starts, and the scored positions' features [rows, F] (a feature drafter
        needs them all)."""
        lps: dict[int, tuple[TokenLogprob, ...]] = {}
        at: dict[int, int] = {}
        feats: dict[int, torch.Tensor] = {}
        for i, (r, s) in enumerate(zip(reqs, seqs)):
            n = s.prompt_logprobs
            if n is None:
                continue
            start = s.num_computed
            end = start + chunks[i] - 1 if i in chunks else max(start, s.prompt_len - 1)
            out: list[TokenLogprob] = list(s.prompt_scored[:start])  # the earlier pieces'
            parts: list[torch.Tensor] = []
            for a in range(start, end, PROMPT_LOGITS_ROWS):
                b = min(end, a + PROMPT_LOGITS_ROWS)
                rows = self._forward([ForwardItem(r.seq_id, a, s.tokens[a:b], b - a)], s.feature_layers, parts)[0]  # [b - a, V]
                out.extend(token_logprobs(rows, s.tokens[a + 1:b + 1], [n] * (b - a)))
                del rows
            s.prompt_scored = out
            lps[i], at[i] = tuple(out), end
            if parts:
                feats[i] = torch.cat(parts)
        return lps, at, feats

    @staticmethod
    def _score_piece_end(s: _Seq, row: torch.Tensor) -> None:
        """A prompt piece's last row [1, V] (the step's forward computed it) scores the prompt token
        after the piece: prompt_scored[j] scores token j + 1, and _score_prompts scored every
        position before this row's."""
        s.prompt_scored.extend(token_logprobs(row, [s.tokens[len(s.prompt_scored) + 1]], [s.prompt_logprobs]))

    def _prefilled(self, seq_id: str, s: _Seq, n: int) -> VerifyResult:
        """A prompt piece of n tokens is in the KV now; nothing is emitted. Its features (if asked)
        go to the drafter like any committed position's."""
        start = s.num_computed
        s.num_computed += n
        s.undo = None  # nothing to abandon: no tokens were emitted
        self._keep_reserved(seq_id, s)
        feats, s.step_features = s.step_features, None
        return VerifyResult(seq_id, 0, (), features=feats, features_start=start)

    def _add_logprobs(self, idx, seqs, logits, results) -> None:
        """Logprobs of the emitted tokens from the rows this verify already has: row j of a
        sequence's [k+1, V] logits scored the token emitted at position j. A pending sequence keeps
        its rows through the rejection for resolve, which emits the recovered token."""
        done = []
        for i in idx:
            res = results[i]
            if res.pending_position is not None:
                seqs[i].pending_logits = logits[i][: res.pending_position + 1].clone()  # [n+1, V]
            else:
                done.append(i)
        if not done:
            return
        lps = seq_logprobs([logits[i][: len(results[i].token_ids)] for i in done],  # per seq [n+1, V]
                           [results[i].token_ids for i in done], [seqs[i].logprobs for i in done])
        for i, lp in zip(done, lps):
            results[i] = replace(results[i], logprobs=lp)

    def _padded_drafts(self, idx: list[int], reqs: Sequence[VerifyRequest]) -> tuple[torch.Tensor, torch.Tensor, int]:
        k_max = max(len(reqs[i].draft_token_ids) for i in idx)
        drafts = torch.full((len(idx), k_max), -1, dtype=torch.int64)  # [B, K]
        for row, i in enumerate(idx):
            d = reqs[i].draft_token_ids
            drafts[row, : len(d)] = torch.tensor(d, dtype=torch.int64)
        num_draft = torch.tensor([len(reqs[i].draft_token_ids) for i in idx], dtype=torch.int64)  # [B]
        return drafts, num_draft, k_max

    @staticmethod
    def _targets(idx, seqs, logits) -> list[list[int]]:
        """Per sequence in idx, the target's token at each verified row: its argmax, or for a
        coupled (seeded) one argmax(log p_j + g_j) with the noise both sides share."""
        coupled = [i for i in idx if seqs[i].params.coupled]
        probs = dict(zip(coupled, _probs([logits[i] for i in coupled], [seqs[i].params for i in coupled]))) if coupled else {}
        targets = []
        for i in idx:
            if i in probs:
                s, start = seqs[i], len(seqs[i].tokens)
                targets.append([coupled_sample(p, s.params.seed, start + j) for j, p in enumerate(probs[i])])
            else:
                targets.append(greedy_ids(logits[i]).tolist())
        return targets

    def _accept_greedy(self, idx, reqs, seqs, targets: list[list[int]], results) -> None:
        """Accept each sequence's drafts while they equal the target's tokens (targets [k + 1] per
        sequence in idx), then commit them and the target's next token."""
        accepted = self.sampler.greedy_host([reqs[i].draft_token_ids for i in idx], targets)
        for i, a, n in zip(idx, targets, accepted):
            results[i] = self._commit(reqs[i].seq_id, seqs[i], n, a[: n + 1])

    def _verify_tree(self, seq_id: str, s: _Seq, tree: DraftTree, argmax: list[int], results: list, i: int) -> list[int]:
        """Greedy acceptance of a draft tree from the target's argmax at its rows [1 + n] (row 0:
        the root, row 1 + j: node j): the longest path of nodes that equal the target's argmax at
        their parent's row, then the bonus from the last accepted row. The path's KV moves to the
        slots a chain would have used (the rest is cut by _commit), so the sequence is as if the
        chain of the path had been verified. Returns the path's rows [1 + a] (to reorder logits)."""
        path = tree.greedy_walk(argmax)
        rows = [0] + [1 + j for j in path]
        emitted = [tree.tokens[j] for j in path] + [argmax[rows[-1]]]
        base = len(s.tokens)  # node j was written at position base + j; path node d goes to base + d
        self.runner.move_kv(seq_id, [base + j for j in path], [base + d for d in range(len(path))])
        if s.step_features is not None:  # rows from the step's start: the uncached tail, then the nodes
            tail = s.step_features.shape[0] - len(tree)
            s.step_features = torch.cat([s.step_features[:tail], s.step_features[[tail + j for j in path]]])
        results[i] = self._commit(seq_id, s, len(path), emitted)
        return rows

    def _verify_sampled(self, idx, reqs, seqs, logits, results) -> None:
        drafts, num_draft, k_max = self._padded_drafts(idx, reqs)
        probs = _probs([logits[i] for i in idx], [seqs[i].params for i in idx])  # per seq [k+1, V]
        vocab = self.vocab_size
        target = torch.zeros((len(idx), k_max + 1, vocab), dtype=torch.float32, device=probs[0].device)
        q_x = torch.ones((len(idx), k_max), dtype=torch.float32)
        u_accept = torch.zeros((len(idx), k_max), dtype=torch.float64)
        u_final = torch.zeros(len(idx), dtype=torch.float64)
        for row, i in enumerate(idx):
            k = len(reqs[i].draft_token_ids)
            target[row, : k + 1] = probs[row]
            if k:
                q_x[row, :k] = torch.tensor(reqs[i].draft_probs, dtype=torch.float32)
            # Keyed by position (specsplit.sampling.rng): the draft j lands at len(tokens) + j.
            u_accept[row, :k] = seqs[i].rng.uniforms(len(seqs[i].tokens), k, "accept")
        num_accepted = self.sampler.accept(drafts, q_x.to(target.device), num_draft, target, u_accept)
        for row, i in enumerate(idx):  # the final uniform belongs to the position where the step stops
            u_final[row] = seqs[i].rng.uniform(len(seqs[i].tokens) + int(num_accepted[row]), "final")
        finish_rows: list[int] = []
        for row, i in enumerate(idx):
            n, k = int(num_accepted[row]), len(reqs[i].draft_token_ids)
            s = seqs[i]
            if n < k and float(reqs[i].draft_probs[n]) != 1.0:
                # Rejected a sampled draft: the residual needs the draft's q row at position n.
                s.p_row = target[row, n].clone()
                s.pending_accepted = n
                s.pending_u = float(u_final[row])
                s.pending_drafts = list(reqs[i].draft_token_ids[:n])
                results[i] = VerifyResult(reqs[i].seq_id, n, (), pending_position=n)
            else:
                finish_rows.append(row)
        if finish_rows:
            # All accepted (bonus from p) or rejected a deterministic draft (q one-hot at it).
            p_rows = torch.stack([target[row, int(num_accepted[row])] for row in finish_rows])  # [F, V]
            q_rows = torch.zeros_like(p_rows)
            for j, row in enumerate(finish_rows):
                n, k = int(num_accepted[row]), int(num_draft[row])
                if n < k:
                    q_rows[j, int(drafts[row, n])] = 1.0
            final = self.sampler.finish(p_rows, q_rows, u_final[finish_rows])
            for j, row in enumerate(finish_rows):
                i, n = idx[row], int(num_accepted[row])
                emitted = list(reqs[i].draft_token_ids[:n]) + [int(final[j])]
                results[i] = self._commit(reqs[i].seq_id, seqs[i], n, emitted)

    def resolve(self, rows: Sequence[QRow]) -> list[VerifyResult]:
        if not rows:
            return []
        seqs = [self._get(r.seq_id) for r in rows]
        for r, s in zip(rows, seqs):
            if s.p_row is None:
                raise EngineError(f"sequence {r.seq_id!r} has no pending rejection to resolve")
            if r.row.shape != (self.vocab_size,):
                raise EngineError(f"sequence {r.seq_id!r}: q row has shape {tuple(r.row.shape)}, expected ({self.vocab_size},)")
        p = torch.stack([s.p_row for s in seqs])  # [B, V]
        q = torch.stack([r.row.to(device=p.device, dtype=torch.float32) for r in rows])  # [B, V]
        u = torch.tensor([s.pending_u for s in seqs], dtype=torch.float64)
        final = self.sampler.finish(p, q, u)
        out = []
        for j, (r, s) in enumerate(zip(rows, seqs)):
            n = s.pending_accepted
            emitted = s.pending_drafts + [int(final[j])]
            s.p_row = None
            s.pending_drafts = []
            out.append(self._commit(r.seq_id, s, n, emitted))
        asked = [j for j, s in enumerate(seqs) if s.pending_logits is not None]
        if asked:
            lps = seq_logprobs([seqs[j].pending_logits for j in asked], [out[j].token_ids for j in asked],
                               [seqs[j].logprobs for j in asked])
            for j, lp in zip(asked, lps):
                seqs[j].pending_logits = None
                out[j] = replace(out[j], logprobs=lp)
        return out

    def abandon(self, seq_ids: Sequence[str]) -> None:
        """Undo the last verify (and resolve) of these sequences: no pending rejection, none of the
        tokens that step emitted, KV as before it. Unknown ids and sequences not stepped since they
        were added are left alone. Used by SpecDecoder's exact fallback when the drafter's q rows
        are lost mid-step: the step is discarded as a whole, whatever its outcome."""
        for seq_id in seq_ids:
            s = self.seqs.get(seq_id)
            if s is None or s.undo is None:
                continue
            length, num_computed = s.undo
            del s.tokens[length:]
            s.num_computed = num_computed
            s.p_row, s.pending_drafts, s.pending_accepted, s.undo = None, [], 0, None
            s.pending_logits = None
            s.step_features = None
            self.runner.truncate(seq_id, num_computed)

    def _commit(self, seq_id: str, s: _Seq, num_accepted: int, emitted: list[int]) -> VerifyResult:
        """Append the emitted tokens; keep KV (and return features) only through the accepted drafts."""
        before, start = len(s.tokens), s.undo[1] if s.undo else s.num_computed
        s.tokens.extend(emitted)
        s.num_computed = before + num_accepted  # the bonus/recovered token is not in the KV yet
        self.runner.truncate(seq_id, s.num_computed)
        feats = None
        if s.step_features is not None:
            feats, s.step_features = s.step_features[: s.num_computed - start], None
        return VerifyResult(seq_id, num_accepted, tuple(emitted), features=feats, features_start=start)


class DraftEngine(_EngineBase, DrafterTraits):
    """The draft model: catches up on emitted tokens, rolls back rejected drafts, drafts k more."""

    side = "drafter"
    # The drafter applies a sequence's penalties and logit_bias to its own logits, and with a
    # compiler (the builders share the verifier's, or give the service its own) its grammar's mask,
    # so its drafts follow the target's rules and fewer are rejected or cut; q is the distribution
    # the draft was drawn from (rejection sampling stays exact whatever q is). The mask is best
    # effort: without a compiler, until a grammar is compiled (DraftGrammar: never waited for), or
    # where it cannot follow (a grammar that does not compile here, a chain with tokens outside
    # it), the drafter drafts unmasked and the verifier cuts.
    grammars: GrammarCompiler | None = None

    def add(self, seqs: Sequence[SeqAdd]) -> None:
        super().add(seqs)
        for a in seqs:
            self.seqs[a.seq_id].grammar = draft_grammar(self.grammars, a.seq_id, a.params)

    def _process(self, s: _Seq, logits: torch.Tensor) -> torch.Tensor:
        """logits [1, V] of the next draft of `s`: penalized from its tokens and chain (as the
        verifier does), then masked by its grammar there."""
        generated = s.tokens[s.prompt_len:] + s.drafted
        rows = penalize(logits, s.params, s.tokens[:s.prompt_len], generated)  # a float32 copy
        mask = draft_mask(s.grammar, generated)
        if mask is not None:
            apply_masks(rows, mask)
        return rows

    def propose(self, reqs: Sequence[ProposeRequest]) -> list[Proposal]:
        """Per request: ingest new_token_ids, then draft k tokens after them and `pending_drafts` (the drafts
        being verified now, when pre-drafting); returns only the k new drafts."""
        seqs = [self._get(r.seq_id) for r in reqs]
        for r, s in zip(reqs, seqs):
            check_propose(r, s, self.vocab_size, self.runner.max_model_len)
        for r, s in zip(reqs, seqs):
            self._ingest(r.seq_id, s, r.new_token_ids, r.pending_drafts)
            # final tokens in the KV (not the last: a propose may feed it again) -> reusable prefix
            self.block_manager.cache_prefix(r.seq_id, s.tokens, min(s.num_computed, len(s.tokens) - 1))
        self._prefill([(r, s) for r, s in zip(reqs, seqs) if r.k <= 0 and r.prefill_tokens > 0])
        active = [i for i, r in enumerate(reqs) if r.k > 0]
        for i in active:
            s = seqs[i]
            if s.num_computed >= len(s.tokens) + len(s.drafted):
                # Every token is in the KV already (the last step emitted nothing: the gateway
                # abandoned it): feed the last one again to get the logits that draft the next.
                s.num_computed = len(s.tokens) + len(s.drafted) - 1
                self.runner.truncate(reqs[i].seq_id, s.num_computed)
        k_max = max((reqs[i].k for i in active), default=0)
        q_x: dict[int, list[float]] = {i: [] for i in active}
        rows: dict[int, list[torch.Tensor]] = {i: [] for i in active}
        # Trees: per sequence that may add leaves, each draft's (top-1 probability, runner-up id)
        alternatives = {i: [] for i in active if reqs[i].tree_nodes > 0 and not reqs[i].pending_drafts
                        and tree_eligible(seqs[i].params)}
        for step in range(k_max):
            live = [i for i in active if reqs[i].k > step]
            items = []
            for i in live:
                s = seqs[i]
                items.append(ForwardItem(reqs[i].seq_id, s.num_computed, chain_tail(s.tokens, s.drafted, s.num_computed), 1))
                s.num_computed = len(s.tokens) + len(s.drafted)
            logits = self._forward(items)  # per seq [1, V]
            logits = [self._process(seqs[i], x) if seqs[i].grammar is not None
                      or seqs[i].params.penalized_at(seqs[i].num_generated) else x for i, x in zip(live, logits)]
            tokens = self._sample([seqs[i] for i in live], logits, q_x, rows, live)
            for i, x in zip(live, logits):
                if i in alternatives:
                    alternatives[i].append(runner_up(x[0]))
            for i, t in zip(live, tokens):
                seqs[i].drafted.append(t)
        out = []
        for i, (r, s) in enumerate(zip(reqs, seqs)):
            new = s.drafted[len(r.pending_drafts):]
            sampled = bool(rows.get(i))
            s.q_rows.extend(rows[i] if sampled else [None] * len(new))  # [V] per draft, kept with the chain
            out.append(chain_proposal(r.seq_id, new, q_x[i] if sampled else None, alternatives.get(i), r.tree_nodes))
        return out

    def _prefill(self, pieces: list[tuple[ProposeRequest, _Seq]]) -> None:
        """Chunked prefill: each sequence computes up to prefill_tokens of its uncached context, in
        one forward, never its last token (the propose that drafts feeds that one)."""
        items, done = [], []
        for r, s in pieces:
            n = min(r.prefill_tokens, len(s.tokens) + len(s.drafted) - 1 - s.num_computed)
            if n > 0:
                items.append(ForwardItem(r.seq_id, s.num_computed, chain_tail(s.tokens, s.drafted, s.num_computed)[:n], 1))
                done.append((r.seq_id, s, n))
        if not items:
            return
        self._forward(items)
        for seq_id, s, n in done:
            s.num_computed += n
            self._keep_reserved(seq_id, s)

    def _ingest(self, seq_id: str, s: _Seq, new: Sequence[int], pending: Sequence[int] = ()) -> None:
        """ingest_chain, then KV kept only for the final tokens and the confirmed old drafts."""
        before = len(s.tokens)
        matched = ingest_chain(s, new, pending)
        s.num_computed = min(s.num_computed, before + matched)
        self.runner.truncate(seq_id, s.num_computed)

    def _sample(self, seqs: list[_Seq], logits: list[torch.Tensor], q_x, rows, live) -> list[int]:
        return sample_drafts(seqs, logits, q_x, rows, live)

    @property
    def num_q_rows(self) -> int:
        """q rows kept across every sequence (bounded by the chains: see fetch_rows)."""
        return sum(1 for s in self.seqs.values() for r in s.q_rows if r is not None)

    def fetch_rows(self, fetch: Sequence[RowRequest]) -> list[QRow]:
        """The requested q rows (at most K + 1 + K per sequence while pre-drafting, K otherwise)."""
        return fetch_q_rows(self._get, fetch)


class NgramDrafter(DrafterTraits):
    """Prompt-lookup drafting with no model; implements the Drafter protocol.

    Its drafts are deterministic, so q(x) = 1 and the q row is one-hot: the verifier resolves
    rejections locally and fetch_rows never needs to send a row.
    """

    side = "drafter"

    def __init__(self, n_min: int = 1, n_max: int = 4, vocab_size: int | None = None, max_model_len: int | None = None):
        self.n_min, self.n_max = n_min, n_max
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.seqs: dict[str, list[int]] = {}

    @property
    def num_running(self) -> int:
        return len(self.seqs)

    def add(self, seqs: Sequence[SeqAdd]) -> None:
        check_seq_adds(seqs, self.seqs, self.side, self.vocab_size, self.max_model_len)
        for s in seqs:
            self.seqs[s.seq_id] = list(s.prompt_token_ids)

    def propose(self, reqs: Sequence[ProposeRequest]) -> list[Proposal]:
        out = []
        for r in reqs:
            if r.seq_id not in self.seqs:
                raise EngineError(f"unknown sequence {r.seq_id!r} on the drafter: add it first")
            tokens = self.seqs[r.seq_id]
            tokens.extend(r.new_token_ids)
            context = tokens + list(r.pending_drafts)
            if r.k > 0 and r.tree_nodes > 0:  # the continuations of several earlier matches: a tree
                tree = DraftTree.from_branches(ngram_branches(context, r.k, 1 + r.tree_nodes, self.n_min, self.n_max))
                tree = tree.first(r.k + r.tree_nodes)
                out.append(Proposal(r.seq_id, tree.tokens, tuple(1.0 for _ in tree.tokens),
                                    None if tree.is_chain else tree.parents))
                continue
            drafts = ngram_propose(context, r.k, self.n_min, self.n_max) if r.k > 0 else []
            out.append(Proposal(r.seq_id, tuple(drafts), tuple(1.0 for _ in drafts)))
        return out

    def fetch_rows(self, fetch: Sequence[RowRequest]) -> list[QRow]:
        if fetch:
            raise EngineError("the n-gram drafter's q rows are one-hot; the verifier resolves them itself")
        return []

    def release(self, seq_ids: Sequence[str], finished: bool = False) -> None:
        for seq_id in seq_ids:
            self.seqs.pop(seq_id, None)
