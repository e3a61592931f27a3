"""A draft model and a lookup behind one Drafter: `--draft MODEL+ngram` (prompt lookup) or
`MODEL+suffix` (suffix drafting over the request and the shared cache of finished outputs,
specsplit/suffix_drafter.py: it fires when its draft's expected accepted count is >= 1, on a
match of `ngram_min` tokens or more).

Each step and each greedy sequence, prompt lookup goes first: when the context's last
`ngram_min` (or more) tokens occurred before and k tokens followed them, those k tokens are the
drafts and the model only ingests the step's new tokens (no draft forwards for that sequence).
Otherwise the model drafts min(k, model_tokens) tokens: a lookup draft costs nothing and, once it
matches, tends to run on, while a small draft model's acceptance falls with every position, so
their best K differ.

Measured on the target's own greedy continuations of 32 held-out ShareGPT prompts
(tools/distill_draft.py's eval set) with the distilled 2-layer draft (agreement 0.30): a 1-token
suffix match fires at 57% of positions and is right 45% of the time there (the model: 25%);
a greedy replay of speculation over that set (exact: the accepted prefix only depends on
teacher-forced predictions), with a draft forward at 0.1 of a target forward and flat verify
cost (bf16 on this AMX CPU), predicts 1.17x for the model alone (best K=1), 1.26x for lookup
alone (best K=3) and 1.43x for both (lookup K=3, model 1 token).

Before an EAGLE-3 head the lookup needs a longer match (FEATURE_NGRAM_MIN), prompt lookup and
the suffix drafter alike: the head is right more often than a short match. (A suffix match's
expected count cannot tell: a 1-token match seen once reads as certain. Without the minimum,
`smollm2-135m-eagle3+suffix` took 862 steps where `+ngram` took 773 for the same tokens; with it,
764. tools/hybrid_acceptance.py, thirteenth session, docs/suffix-drafter.md.)

Sampled requests always use the model: its q rows are what the rejection sampler needs, and
mixing a one-hot lookup draft into a sampled step would change nothing about losslessness but
would need per-position q bookkeeping the wire does not carry. Greedy output stays the
target's token for token whichever proposer drafted (the verifier decides).
"""
from __future__ import annotations

from dataclasses import replace

from typing import Sequence

from specsplit.engine import DraftEngine, EngineError
from specsplit.protocols import DrafterTraits, Proposal, ProposeRequest, QRow, RowRequest, SeqAdd
from specsplit.sampling.ngram import ngram_propose
from specsplit.sampling.params import SamplingParams
from specsplit.sampling.rejection import matched_prefix
from specsplit.suffix_drafter import SuffixDrafter

# Before an EAGLE-3 head (a feature drafter), prompt lookup (or the suffix drafter, MODEL+suffix)
# goes first only on a match of this many tokens or more. Measured (fifth session, SmolLM2-135M +
# the shipped head, K=3, greedy, 64 tokens, held-out ShareGPT prompts 17-40 with the chat
# template, tools/hybrid_acceptance.py): a
# 1-token match fired at 42% of steps and its drafts were accepted 0.74 per step against the
# head's 0.76, so it cost steps (854 vs 795 with the head alone); from 3 tokens it fires at 11%,
# is accepted 1.94 per step there, and the run takes the fewest steps (777). The small draft
# model, weaker than a 1-token match, keeps SpecConfig.ngram_min (1).
FEATURE_NGRAM_MIN = 3
SUFFIX_FIRES = 1.0  # MODEL+suffix: the suffix draft wins when its expected accepted count reaches this


class HybridDrafter(DrafterTraits):
    """Implements the Drafter protocol over a DraftEngine plus prompt lookup on the same tokens."""

    side = "drafter"

    def __init__(self, model: DraftEngine, ngram_min: int = 1, ngram_max: int = 4, model_tokens: int = 1,
                 suffix: SuffixDrafter | None = None):
        self.model = model
        self.suffix = suffix  # MODEL+suffix: the suffix drafter's lookups instead of prompt lookup
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        # the K policy prices only this many model drafts per step (0 = k)
        self.model_tokens: int | None = model_tokens
        self.tokens: dict[str, list[int]] = {}  # the context as the drafter knows it
        self.params: dict[str, SamplingParams] = {}
        self.lookup_steps = 0  # sequence-steps drafted by prompt lookup
        self.model_steps = 0  # sequence-steps drafted by the model
        # Draft tokens proposed and accepted, by who drafted them ("lookup", "model"), as the drafter
        # sees it: a proposal's accepted prefix is read off the tokens the next propose brings
        # (lockstep proposals only; a pre-draft branch is not judged).
        self.judged: dict[str, list[int]] = {"lookup": [0, 0], "model": [0, 0]}
        self._last: dict[str, tuple[str, tuple[int, ...]]] = {}  # seq_id -> (source, drafts) awaiting judgement

    # the model engine's surface the services and the benchmark read
    @property
    def runner(self):
        return self.model.runner

    @property
    def block_manager(self):
        return self.model.block_manager

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    @property
    def model_share(self) -> float:
        """The share of drafting steps the model made (1.0 before any): what drafting costs."""
        total = self.model_steps + self.lookup_steps
        return self.model_steps / total if total else 1.0

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.model.feature_layers

    @property
    def step_costs(self):
        return self.model.step_costs

    @property
    def num_running(self) -> int:
        return self.model.num_running

    def add(self, seqs: Sequence[SeqAdd]) -> None:
        self.model.add(seqs)  # validates (duplicates, ids, length) and allocates first
        for s in seqs:
            self.tokens[s.seq_id] = list(s.prompt_token_ids)
            self.params[s.seq_id] = s.params
            if self.suffix is not None:
                self.suffix.start(s.seq_id, s.prompt_token_ids)

    def propose(self, reqs: Sequence[ProposeRequest]) -> list[Proposal]:
        for r in reqs:
            if r.seq_id not in self.tokens:
                raise EngineError(f"unknown sequence {r.seq_id!r} on the drafter: add it first")
        lookup: dict[str, tuple[int, ...]] = {}
        for r in reqs:
            self._judge(r)
            if self.suffix is not None:
                self.suffix.extend(r.seq_id, r.new_token_ids)
            if r.k <= 0 or not self.params[r.seq_id].accepts_by_match:  # sampled: the model's q rows
                continue
            if self.suffix is not None:
                drafts, expected = self.suffix.draft(r.seq_id, r.k, r.pending_drafts, min_match=self.ngram_min)
                if drafts and expected >= SUFFIX_FIRES:
                    lookup[r.seq_id] = tuple(drafts)
                continue
            context = self.tokens[r.seq_id] + list(r.new_token_ids) + list(r.pending_drafts)
            drafts = ngram_propose(context, r.k, self.ngram_min, self.ngram_max)
            if len(drafts) == r.k:
                lookup[r.seq_id] = tuple(drafts)
        # The model sees every sequence's new tokens (k = 0: ingest only, where lookup drafted),
        # so its KV stays in step and it can draft for that sequence next time. A pre-draft runs
        # off the critical path, so there the model may draft all k.
        # Chains only (tree_nodes 0): a hybrid judges its sources position by position.
        model_reqs = [replace(r, k=0 if r.seq_id in lookup else (r.k if r.pre_draft else self._model_k(r.k)), pre_draft=False,
                              tree_nodes=0)
                      for r in reqs]
        proposals = self.model.propose(model_reqs)
        out = []
        for r, p in zip(reqs, proposals):
            self.tokens[r.seq_id].extend(r.new_token_ids)
            if r.seq_id in lookup:
                self.lookup_steps += 1
                out.append(Proposal(r.seq_id, lookup[r.seq_id], None))
            else:
                self.model_steps += int(r.k > 0)
                out.append(p)
            source = "lookup" if r.seq_id in lookup else "model"
            if out[-1].token_ids and not r.pre_draft:
                self._last[r.seq_id] = (source, tuple(out[-1].token_ids))
                self.judged[source][0] += len(out[-1].token_ids)
        return out

    def _judge(self, r: ProposeRequest) -> None:
        """Count how much of this sequence's last (lockstep) proposal the verifier accepted."""
        last = self._last.pop(r.seq_id, None)
        if last is None or r.pending_drafts or not r.new_token_ids:
            return
        source, drafts = last
        self.judged[source][1] += matched_prefix(drafts, r.new_token_ids)

    def _model_k(self, k: int) -> int:
        return k if self.model_tokens <= 0 else min(k, self.model_tokens)

    def fetch_rows(self, fetch: Sequence[RowRequest]) -> list[QRow]:
        return self.model.fetch_rows(fetch)  # only sampled (model-drafted) sequences have rows

    def release(self, seq_ids: Sequence[str], finished: bool = False) -> None:
        self.model.release(seq_ids)
        for seq_id in seq_ids:
            self._last.pop(seq_id, None)
        if self.suffix is not None:
            for seq_id in seq_ids:
                self.suffix.finish(seq_id, finished)
        for seq_id in seq_ids:
            self.tokens.pop(seq_id, None)
            self.params.pop(seq_id, None)
