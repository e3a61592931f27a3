"""The two small protocols the speculative step depends on, and the messages they exchange.

In-process engines (specsplit.engine) and gRPC clients (specsplit.gateway.peer_clients) both implement them; the
step (specsplit.spec) and the scheduler never know which one they hold.

Lifecycle of one sequence, on each side:  add -> step ... step -> release.

Token bookkeeping (deltas only, never the whole context):
  * The verifier emitted every token after the prompt, so it needs only the draft tokens.
  * The drafter is sent, at each propose, the tokens emitted since it last saw the sequence
    (accepted drafts + the bonus/recovered token, or several steps' worth after speculation was
    off). It compares them with what it drafted, truncates its KV to the common prefix and
    catches up on the rest before drafting k more.

q (the draft distribution) crosses only where the math needs it: greedy needs none; sampling
needs q(x) of each drafted token, and the full q row only at the first rejected position, fetched
with Drafter.fetch_rows after the verifier says which position that is.
"""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, Sequence

import torch

from specsplit.sampling.logprobs import TokenLogprob  # defined with the function that makes them
from specsplit.sampling.params import SamplingParams

if TYPE_CHECKING:
    from specsplit.calibration import StepCosts
    from specsplit.kv.block_manager import BlockManager
    from specsplit.suffix_drafter import SuffixDrafter


@dataclass(frozen=True)
class SeqAdd:
    seq_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams = SamplingParams()
    # None: no log-probabilities. n (0..20): the verifier returns, for each token it emits for this
    # sequence, its log-probability under the target and the n most likely alternatives.
    logprobs: int | None = None
    # Verifier only: the target layers whose outputs (fused, in this order) it returns with each
    # step's result for this sequence, for a feature drafter (specsplit.feature_drafter). () = none.
    feature_layers: tuple[int, ...] = ()
    # The last `generated` tokens of prompt_token_ids are output already (a resumed sequence after
    # a preemption): penalties count them as generated, a grammar's matcher takes them.
    generated: int = 0
    # Verifier only. None: the prompt is not scored. n (0..20): its first verify (the prefill)
    # returns the log-probability of every prompt token after the first and the n most likely
    # alternatives at each position (VerifyResult.prompt_logprobs).
    prompt_logprobs: int | None = None


@dataclass(frozen=True)
class ProposeRequest:
    seq_id: str
    new_token_ids: tuple[int, ...]  # tokens emitted since the drafter last saw this sequence
    k: int  # tokens to draft; 0 = only ingest new_token_ids
    # Pre-drafting (specsplit.spec, async): draft the k tokens that follow new_token_ids +
    # pending_drafts, the drafts being verified right now (not final). The first of the k is the
    # drafter's guess of the step's bonus token, the rest the next step's drafts on that branch.
    pending_drafts: tuple[int, ...] = ()
    pre_draft: bool = False  # off the critical path (a hybrid drafter lets its model draft all k)
    # A feature drafter's input: the target's fused features [rows, F] of the positions
    # features_start.. that the verifier committed since the drafter last heard (None: none).
    features: torch.Tensor | None = None
    features_start: int = 0
    # Tree verification (specsplit.draft_tree): the drafter may propose up to this many nodes
    # beyond the k of its chain, as branches (a tree of depth <= k). 0 = a chain. Set only for
    # greedy sequences the verifier scores as trees (draft_tree.tree_eligible).
    tree_nodes: int = 0
    # Chunked prefill (k = 0 only): after ingesting, compute the KV of at most this many of the
    # context's tokens not yet cached, never its last one (the next propose feeds that to draft).
    # 0 = none: the next propose with k > 0 computes the whole context, as before.
    prefill_tokens: int = 0


@dataclass(frozen=True)
class Proposal:
    seq_id: str
    token_ids: tuple[int, ...]  # k drafted ids (a tree: its nodes, parents before children)
    probs: tuple[float, ...] | None = None  # q(x) of each drafted id; None when greedy
    parents: tuple[int, ...] | None = None  # a tree: parent node per node (-1: the root); None = a chain


@dataclass(frozen=True)
class RowRequest:
    seq_id: str
    position: int  # index into the drafter's chain of drafts past the last tokens it was sent (0-based)


@dataclass(frozen=True)
class VerifyRequest:
    seq_id: str
    draft_token_ids: tuple[int, ...] = ()  # empty = target-only decode of one token
    draft_probs: tuple[float, ...] | None = None  # q(x) per draft id; needed when sampling
    # A tree of drafts (greedy only, specsplit.draft_tree): parent node per draft, -1 for a child of
    # the last token. None = a chain. The verifier keeps the longest accepted path.
    draft_parents: tuple[int, ...] | None = None
    # Chunked prefill: compute the KV of at most this many of the sequence's tokens not yet cached.
    # When that leaves some uncached (a prompt longer than the chunk) the sequence emits nothing
    # this step (a VerifyResult with no tokens) and may have no drafts. 0 = all of them (a step).
    prefill_tokens: int = 0


@dataclass(frozen=True)
class VerifyResult:
    seq_id: str
    num_accepted: int  # draft tokens accepted
    token_ids: tuple[int, ...]  # emitted: accepted drafts + one bonus/recovered (empty if pending)
    pending_position: int | None = None  # sampling: first rejected position, awaiting q row
    # One per token in token_ids when the sequence asked for logprobs (SeqAdd.logprobs); else None.
    logprobs: tuple[TokenLogprob, ...] | None = None
    # SeqAdd.feature_layers set: the fused features [rows, F] of the positions features_start..
    # this step committed to the target's KV (the tokens before the emitted bonus/recovered one).
    features: torch.Tensor | None = None
    features_start: int = 0
    # SeqAdd.prompt_logprobs set: on the result of its first verify, one per prompt token after
    # the first (len(prompt) - 1, in order); else None.
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass
class QRow:
    seq_id: str
    row: torch.Tensor  # [vocab] float32, the draft distribution at the requested position


class DrafterTraits:
    """What the step, the K policy and the scheduler read of a drafter beside its calls, with the
    values of a drafter that has none of it. Every Drafter inherits this and overrides what
    applies (a property or an attribute); nobody probes for a missing name."""

    # The target layers whose fused outputs it reads (a feature drafter); the verifier returns
    # them with each step's result. () = none.
    feature_layers: tuple[int, ...] = ()
    # Calibrated drafting cost (specsplit.calibration, timed at start-up); None = not measured.
    step_costs: "StepCosts | None" = None
    # A hybrid (model + prompt lookup): the most tokens its model drafts a step (0 = all k), for
    # the K policy's price of a step. None = not a hybrid.
    model_tokens: int | None = None
    # The share of drafting steps on which its model drafted (what drafting costs); 1.0 = always.
    model_share: float = 1.0
    # Its in-process paged KV cache (the scheduler admits against it); None = none or remote.
    block_manager: "BlockManager | None" = None
    # The suffix lookups it drafts with (`suffix`, MODEL+suffix; metrics read them); None = none.
    suffix: "SuffixDrafter | None" = None
    # The most tokens a sequence may hold on it (prompt + drafts); None = no limit of its own. A
    # sequence past it decodes target-only, alone (spec/decoder.py); the others still speculate.
    max_model_len: int | None = None
    # A remote drafter's deadline (seconds) for the next propose / fetch_rows, set by the step from
    # how long verifying takes (spec/decoder.py); None = the client's own timeout. In-process
    # drafters ignore it.
    deadline_s: float | None = None

    def reachable(self, timeout: float) -> bool:
        """Whether it answers now (a remote drafter: GetInfo within `timeout`)."""
        return True

    def probe(self, timeout: float) -> "Future[bool]":
        """`reachable`, answered off the step thread: a remote drafter runs it on a thread of its
        own, so a hung drafter never holds a step (spec/drafter_health.py checks the future without
        waiting). In-process drafters answer at once."""
        done: Future[bool] = Future()
        done.set_result(self.reachable(timeout))
        return done


class VerifierTraits:
    """What the step and the scheduler read of a verifier beside its calls (see DrafterTraits)."""

    # The target's vocabulary: bounds for drafted ids and q rows; None = not known (unchecked).
    vocab_size: int | None = None
    step_costs: "StepCosts | None" = None  # calibrated verify cost per (batch, k)
    block_manager: "BlockManager | None" = None  # its in-process paged KV cache; None = remote


class Drafter(Protocol):
    feature_layers: tuple[int, ...]
    step_costs: "StepCosts | None"
    model_tokens: int | None
    model_share: float
    block_manager: "BlockManager | None"

    def add(self, seqs: Sequence[SeqAdd]) -> None: ...

    def propose(self, reqs: Sequence[ProposeRequest]) -> list[Proposal]: ...

    def fetch_rows(self, fetch: Sequence[RowRequest]) -> list[QRow]:
        """Return the requested q rows (the drafter keeps a sampled draft's q row until the tokens
        that follow show it was verified: the next propose)."""
        ...

    def release(self, seq_ids: Sequence[str], finished: bool = False) -> None:
        """Free the sequences. finished: they ended normally (stop or length), so their output
        may feed what the drafter learns from (specsplit.suffix_drafter; never a live request's)."""
        ...


class Verifier(Protocol):
    vocab_size: int | None
    step_costs: "StepCosts | None"
    block_manager: "BlockManager | None"

    def add(self, seqs: Sequence[SeqAdd]) -> None: ...

    def verify(self, reqs: Sequence[VerifyRequest]) -> list[VerifyResult]: ...

    def resolve(self, rows: Sequence[QRow]) -> list[VerifyResult]:
        """Finish sequences left pending by verify, sampling from normalize(max(0, p - q))."""
        ...

    def abandon(self, seq_ids: Sequence[str]) -> None:
        """Undo the last step of these sequences (pending or committed): emit nothing for it and
        roll the KV cache back to before it. SpecDecoder's exact fallback when q rows are lost."""
        ...

    def release(self, seq_ids: Sequence[str]) -> None: ...


@dataclass
class StepStats:
    """What one speculative step did, for usage counters and metrics."""

    proposed: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    draft_s: float = 0.0
    verify_s: float = 0.0
    # Asynchronous pre-drafting (specsplit.spec): sequences whose pre-drafted branch matched what
    # the step emitted (hits) or did not (misses), branches drafted, and the seconds the verifier
    # waited for drafts (just-in-time drafting after a miss, or a pre-draft slower than the verify).
    branch_hits: int = 0
    branch_misses: int = 0
    branches: int = 0
    draft_wait_s: float = 0.0
    feature_rows: int = 0  # target feature rows handed to a feature drafter this step
    tree_nodes: int = 0  # branch nodes of draft trees verified this step (beyond their main chains)
    catch_up_pieces: int = 0  # catch-up pieces sent to the drafter this step (spec/decoder.py)
