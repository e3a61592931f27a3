"""SpecDecoder: one speculative step for every running sequence, in five phases.

    k      choose this step's K (the K policy, or the fixed K)            _choose_k
    draft  pre-drafted branches that came true + just-in-time proposals   _drafts
    verify the target scores the drafts (while the next branch drafts)    _verify
    rows   sampling only: the q rows of rejected drafts, then resolve     _resolve_pending
    count  emitted tokens, acceptance, features, branch hits              _account

The step never knows whether it talks to in-process engines or gRPC clients. It keeps, per
sequence, only what the protocol needs (spec/track.py): the tokens the drafter has not been told
about yet (deltas; after speculation was off for a while, several steps' worth) and the full token
list so a restarted drafter can be given the sequence again. Nothing per step (probabilities,
hidden states) is kept here: q rows live on the drafter with its chain of drafts
(specsplit.engine), p rows on the verifier until resolve.

Speculation is off for a step when the batch is larger than `disable_by_batch_size`, when a
request asked for none, or while the drafter is unreachable or late (spec/drafter_health.py: every
stream goes on target-only, with the same greedy tokens, and the drafter is re-synced when it
answers); a sequence the drafter must catch up with (re-synced, or unsent past CATCH_UP_TOKENS)
decodes target-only while it is sent its tokens in bounded pieces (_catch_up_pieces).
"""
from __future__ import annotations

import logging
import random
import time
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Sequence

from specsplit.calibration import StepCosts
from specsplit.config import SpecConfig, step_k_cap
from specsplit.draft_tree import DraftTree, tree_eligible
from specsplit.k_policy import REQUEST_PRIOR_WEIGHT, Acceptance, KPolicy, Pooled, TreeValue, tree_nodes
from specsplit.protocols import (
    Drafter,
    Proposal,
    ProposeRequest,
    RowRequest,
    SeqAdd,
    StepStats,
    TokenLogprob,
    Verifier,
    VerifyRequest,
    VerifyResult,
)
from specsplit.recalibration import Recalibration
from specsplit.spec.drafter_health import DrafterHealth, refused, target_only
from specsplit.spec.peer_checks import (Q_AUDIT_RATE, audit_positions, checked_proposals, claims_problem, claims_q,
                                         rows_problem)
from specsplit.spec.predraft import PreDrafter
from specsplit.spec.track import IDLE_FEATURE_ROWS, MAX_FEATURE_ROWS, Track

log = logging.getLogger("specsplit.spec")

# A remote drafter's deadline per call, from what verifying costs (an exponential average of the
# verify calls): DRAFT_DEADLINE_FACTOR verifies, at least DRAFT_DEADLINE_FLOOR_S (a loopback gRPC
# round trip of a small propose and the services' scheduling, with room: docs/services.md), plus the
# verify's cost per token for each token the drafter must compute first (a catch-up piece, a
# prompt). A drafter slower than one verify cannot pay for itself; a hung one costs the step this
# long, once: the call's stream is cancelled, the drafter is down (spec/drafter_health.py: later
# steps go on target-only without calling it, a probe runs off the step thread, and it is re-synced
# when it answers). Capped by the client's own --drafter-timeout.
DRAFT_DEADLINE_FACTOR = 1.0
DRAFT_DEADLINE_FLOOR_S = 0.05
# The most tokens the drafter computes a step to catch up (all sequences together): a re-added
# sequence (after a re-sync), or one with more unsent tokens than this (speculation was off a
# while), is sent its tokens in pieces of at most this many across steps, decoding target-only
# until the drafter has computed them all; then it drafts again.
CATCH_UP_TOKENS = 64
_EMA = 0.2  # weight of the newest verify call in the average


@dataclass
class StepOutput:
    tokens: dict[str, list[int]]  # seq_id -> tokens emitted this step
    stats: StepStats
    speculated: bool
    drafts: dict[str, tuple[int, int]] = field(default_factory=dict)  # seq_id -> (proposed, accepted)
    k: int = 0  # drafts asked per sequence this step (the K policy's choice, or the fixed K)
    # seq_id -> one TokenLogprob per token in tokens[seq_id], for the sequences that asked
    logprobs: dict[str, tuple[TokenLogprob, ...]] = field(default_factory=dict)
    # seq_id -> its prompt's TokenLogprobs (one per prompt token after the first), on the step of
    # its first verify, for the sequences added with prompt_logprobs
    prompt_logprobs: dict[str, tuple[TokenLogprob, ...]] = field(default_factory=dict)


@dataclass
class _Plan:
    """What this step drafts: its K (0: target-only), the one sequence that drafts when the K
    policy probes (None: all), the tokens each sequence may still emit, and the prompt pieces
    (chunked prefill: seq_id -> tokens) of sequences that emit nothing this step."""

    k: int
    only: str | None
    budgets: dict[str, int]
    chunks: dict[str, int] = field(default_factory=dict)
    # some sequence computes prompt tokens this step (a first step, a prompt piece): not a decode
    # step, so its time says nothing of a decode step's (recalibration, the K policy's probe cost)
    computes_prompt: bool = False


class SpecDecoder:
    def __init__(
        self,
        verifier: Verifier,
        drafter: Drafter | None = None,
        spec: SpecConfig = SpecConfig(),
        max_model_len: int = 2048,
        drafter_retry_s: float = 1.0,
        clock=time.monotonic,
        costs: StepCosts | None = None,
    ):
        self.verifier = verifier
        self._drafter = drafter
        self.spec = spec
        self.max_model_len = max_model_len
        self.health = DrafterHealth(drafter, drafter_retry_s, clock)
        self._hold_next: set[str] = set()  # abandoned this step: target-only next step
        self._hold_now: set[str] = set()  # abandoned last step: no proposal verified this step
        self.tracks: dict[str, Track] = {}
        self.async_draft = spec.async_draft and drafter is not None
        self.predraft = PreDrafter(drafter) if self.async_draft else None
        self.branch_hits = 0
        self.branch_misses = 0
        # Which accepted drafts have their q(x) audited (peer_checks.audit_positions): its own
        # generator, never the sampler's, so the output does not depend on it.
        self._audit_rng = random.Random(0x9A0D17)
        self.q_audit_rate = Q_AUDIT_RATE
        self.q_audits = 0  # accepted drafts whose claimed q(x) was checked against their q row
        self.policy: KPolicy | None = None
        self.k_chosen: Counter[int] = Counter()  # steps per K drafted (0: speculation off that step)
        self._probes = 0  # probe steps so far: which sequence drafts in the next one
        self._verify_s: float | None = None  # average seconds per verify call
        self._verify_token_s: float | None = None  # ... per token it scored
        self._draft_token_s: float | None = None  # the drafter's seconds per token it computed
        self.tree_value = TreeValue()  # what a branch node of a draft tree gained so far
        # every request's acceptance per position: the centre of each new request's prior
        self.pooled = Pooled()
        if costs is not None and costs.verify and spec.k_policy == "auto":
            # A hybrid's model drafts at most model_tokens a step (0: all k, as a feature drafter does)
            hybrid = drafter.model_tokens or None if drafter is not None else None
            self.policy = KPolicy(costs, spec.num_speculative_tokens, hybrid, async_draft=self.async_draft)
        # the policy's verify costs follow the machine's drift, measured on the live verify calls
        self.recalibration = Recalibration(costs) if self.policy is not None else None

    # ---- lifecycle -----------------------------------------------------------------------
    @property
    def drafter(self) -> Drafter | None:
        return self._drafter

    @drafter.setter
    def drafter(self, drafter: Drafter | None) -> None:
        """Swap the drafter (tests wrap a real one in a fault injector); None: target-only."""
        self._drafter = self.health.drafter = drafter
        if self.predraft is not None:
            self.predraft.drafter = drafter

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """Target layers a feature drafter reads (the verifier returns them with each step)."""
        return tuple(self.drafter.feature_layers) if self.drafter is not None else ()

    @property
    def drafter_up(self) -> bool:
        return self.health.up

    @property
    def drafter_retry_s(self) -> float:
        return self.health.retry_s

    @drafter_retry_s.setter
    def drafter_retry_s(self, seconds: float) -> None:
        self.health.retry_s = seconds

    def request_k(self, asked: int | None) -> int:
        """A request's K: what it asked for, at most the server's K (which the KV reservation and
        the engines' forward bound are sized for); unset or 0 = the server's K."""
        server = self.spec.num_speculative_tokens
        return min(asked, server) if asked else server

    def add(self, seq: SeqAdd, num_speculative_tokens: int | None = None, disable: bool = False) -> None:
        """Add to the verifier (errors propagate: nothing is kept) and, best effort, the drafter."""
        if seq.seq_id in self.tracks:
            raise ValueError(f"sequence {seq.seq_id!r} is already running")
        k = 0 if disable else self.request_k(num_speculative_tokens)
        if k > 0 and self.drafter is not None and len(seq.prompt_token_ids) >= self._drafting_len():
            log.info("sequence %s: its prompt (%d tokens) does not fit the drafter's max_model_len %d; it decodes "
                     "target-only", seq.seq_id, len(seq.prompt_token_ids), self._drafting_len())
            k = 0  # this sequence alone: the drafter would refuse it (and a refusal reads as the drafter failing)
        layers = self.feature_layers if k > 0 else ()
        self.verifier.add([replace(seq, feature_layers=layers)] if layers else [seq])
        track = Track(add=seq, k=k, tokens=list(seq.prompt_token_ids), prefill_left=len(seq.prompt_token_ids),
                      behind=len(seq.prompt_token_ids),
                      acceptance=Acceptance(prior_weight=REQUEST_PRIOR_WEIGHT, pooled=self.pooled))
        self.tracks[seq.seq_id] = track
        if self.drafter_up and k > 0:
            try:
                self.drafter.add([seq])
                track.on_drafter = True
            except Exception as e:  # the drafter is optional: never fail a request because of it
                if refused(e):  # this sequence, not the drafter: the others keep speculating
                    target_only(track, e)
                else:
                    self._drafter_failed(e)

    def release(self, seq_ids: Sequence[str], finished: bool = False) -> None:
        """finished: the requests ended normally (stop, length; not aborted or preempted)."""
        ids = [s for s in seq_ids if s in self.tracks]
        on_drafter = [s for s in ids if self.tracks[s].on_drafter]
        for s in ids:
            del self.tracks[s]
            if self.predraft is not None:
                self.predraft.ready.pop(s, None)
        if ids:
            self.verifier.release(ids)
        if on_drafter and self.drafter_up:
            try:
                self.drafter.release(on_drafter, finished=finished)
            except Exception as e:
                self._drafter_failed(e)

    # ---- the step ------------------------------------------------------------------------
    def step(self, budgets: dict[str, int] | None = None, prefill: dict[str, int] | None = None) -> StepOutput:
        """One step for every running sequence. budgets: tokens each may still emit (caps k).

        prefill (chunked prefill; None: every prompt is computed whole in its first step):
        seq_id -> prompt tokens to compute this step, for sequences with Track.prefill_left. One
        given fewer than it has left computes that piece (the verifier and, in step, the drafter)
        and emits nothing; one given the rest steps as usual; one absent or given 0 sits out."""
        stats = StepStats()
        ids = list(self.tracks)
        chunks: dict[str, int] = {}
        if prefill is not None:
            ids = [s for s in ids if not self.tracks[s].prefill_left or prefill.get(s, 0) > 0]
            chunks = {s: n for s, n in prefill.items() if s in self.tracks and 0 < n < self.tracks[s].prefill_left}
        if not ids:
            return StepOutput({}, stats, False)
        self._hold_now, self._hold_next = self._hold_next, set()
        self.health.maybe_resync(self.tracks)
        plan = self._choose_k([s for s in ids if s not in chunks], budgets or {})
        plan.chunks = chunks
        plan.computes_prompt = any(self.tracks[s].prefill_left for s in ids)  # chunks' sequences too
        self.k_chosen[plan.k] += 1
        started = time.perf_counter()
        proposals = self._drafts(ids, plan, stats)
        reqs = [VerifyRequest(s, proposals[s].token_ids, proposals[s].probs, proposals[s].parents)
                if s in proposals and proposals[s].token_ids else VerifyRequest(s, prefill_tokens=chunks.get(s, 0))
                for s in ids]
        results, branches, prompt_logprobs = self._verify(reqs, proposals, plan, stats)
        if self.policy is not None:
            # the whole step, for what probes cost (k_policy.ProbeCost): not one that computed a
            # prompt, nor a probe whose draft never came
            drafted = plan.k == 0 or bool(proposals)
            self.policy.observe(plan.k, None if plan.computes_prompt or not drafted else time.perf_counter() - started)
        out = self._account(reqs, results, branches, asked_drafter=bool(proposals), stats=stats, chunks=chunks)
        out.prompt_logprobs = prompt_logprobs
        out.speculated = bool(proposals)
        out.k = plan.k if proposals else 0
        return out

    # ---- phase 1: K ------------------------------------------------------------------------
    def _choose_k(self, ids: list[str], budgets: dict[str, int]) -> _Plan:
        """The K of this step (the policy's over the sequences that speculate, else the fixed K;
        0 when speculation is off), and the one sequence that drafts when the policy probes."""
        if not (self.drafter_up and self.spec.enabled_for(len(ids))):
            return _Plan(0, None, budgets)
        live = [s for s in ids if self.tracks[s].on_drafter and self.tracks[s].k > 0]
        if not live:
            return _Plan(0, None, budgets)
        if self.policy is None:
            return _Plan(max(self.tracks[s].k for s in live), None, budgets)
        self.policy.model_fraction = float(self.drafter.model_share)
        # Sequences that do not speculate still take a row in the verify forward.
        others = [Acceptance(prior_rate=0.0, prior_weight=1.0)] * (len(ids) - len(live))
        k = self.policy.choose([self.tracks[s].acceptance for s in live] + others,
                               [self.tracks[s].k for s in live] + [0] * len(others))
        if not self.policy.probing:
            return _Plan(k, None, budgets)
        self._probes += 1
        return _Plan(k, live[self._probes % len(live)], budgets)

    def _k_for(self, t: Track, plan: _Plan, extra: int, skip_held: bool = True) -> int:
        """Drafts a sequence may verify in a step that starts `extra` tokens from now (0: none).
        A sequence whose last step was abandoned verifies none this step (skip_held=False: it is
        still asked, so the drafter catches up; checked_proposals drops its drafts)."""
        if not t.on_drafter or t.k <= 0 or (skip_held and t.seq_id in self._hold_now) \
                or plan.only not in (None, t.seq_id) or t.seq_id in plan.chunks or self._lagging(t):
            return 0
        budget = plan.budgets.get(t.seq_id)
        return step_k_cap(min(t.k, plan.k), len(t.tokens) + extra, self._drafting_len(),
                          None if budget is None else budget - extra)

    def _drafting_len(self) -> int:
        """The longest a sequence may be and still draft: the target's max_model_len, or the
        drafter's where it is smaller (a remote drafter's is known once it answered GetInfo)."""
        own = self.drafter.max_model_len if self.drafter is not None else None
        return min(self.max_model_len, own) if own else self.max_model_len

    # ---- phase 2: drafts -------------------------------------------------------------------
    def _drafts(self, ids: list[str], plan: _Plan, stats: StepStats) -> dict[str, Proposal]:
        """This step's checked proposals: the pre-drafted branches that came true, cut to each
        sequence's k now, and just-in-time drafts for the rest."""
        ready = self.predraft.take_ready() if self.predraft is not None else {}
        for s in ids:
            if s in self.tracks:
                self.tracks[s].asked = 0
        pieces = self._prefill_pieces(plan)
        stats.feature_rows += sum(a.features.shape[0] for a in pieces if a.features is not None)
        if plan.k <= 0:
            if pieces:
                self._set_deadline(pieces)
                self._propose(pieces)
            return {}
        catch_up = self._catch_up_pieces(ids, plan)
        stats.catch_up_pieces += len(catch_up)
        stats.feature_rows += sum(a.features.shape[0] for a in catch_up if a.features is not None)
        pieces += catch_up
        proposals = {}
        for s, p in ready.items():
            k = self._k_for(self.tracks[s], plan, extra=0) if s in self.tracks else 0
            if k > 0:
                proposals[s] = Proposal(s, p.token_ids[:k], None if p.probs is None else p.probs[:k])
                self.tracks[s].asked = k
        asks = []
        for s in ids:
            t = self.tracks[s]
            k = 0 if s in proposals else self._k_for(t, plan, extra=0, skip_held=False)
            if k > 0:
                t.asked = k
                feats, start = t.take_features()
                asks.append(ProposeRequest(s, tuple(t.unsent), k, features=feats, features_start=start,
                                           tree_nodes=self._tree_nodes(t, k, len(ids))))
        stats.feature_rows += sum(a.features.shape[0] for a in asks if a.features is not None)
        self._set_deadline(asks + pieces)
        t0 = time.perf_counter()
        proposals.update(self._propose(asks + pieces))
        for a in pieces:  # a prompt piece drafts nothing
            proposals.pop(a.seq_id, None)
        for a in asks:  # no answer (the drafter failed, or was late): nothing to count as its choice
            if a.seq_id not in proposals:
                self.tracks[a.seq_id].asked = 0
        stats.draft_s = time.perf_counter() - t0
        if self.async_draft and asks:
            stats.draft_wait_s = stats.draft_s  # drafted just in time: the verifier waited
        return proposals

    def _tree_nodes(self, t: Track, k: int, batch: int) -> int:
        """Branch nodes this sequence's drafts may add to their chain of k (0: a chain): trees are
        for greedy sequences with unprocessed logits (draft_tree.tree_eligible), in lockstep; the
        auto K policy sizes them from the calibrated verify cost (k_policy.tree_nodes)."""
        room = self.max_model_len - len(t.tokens) - k  # the verifier writes every node's KV
        most = min(self.spec.tree_nodes, room)
        if most <= 0 or self.predraft is not None or not tree_eligible(t.add.params):
            return 0
        if self.policy is None:
            return most
        costs = self.policy.costs
        fixed = max(0.0, self.policy.step_time(batch, k) - costs.verify_rows_s(batch, k + 1))  # drafting, network
        return tree_nodes(costs, batch, k, t.acceptance.expected_tokens(k), self.tree_value.value, most, fixed_s=fixed)

    def _prefill_pieces(self, plan: _Plan) -> list[ProposeRequest]:
        """The drafter computes the same prompt pieces as the verifier, in the same steps, so its
        catch-up when the sequence starts drafting is at most one piece. A feature drafter reads
        the target's features instead: it gets those of the piece before (this step's come back
        from this step's verify), so it too is at most one piece behind."""
        if not plan.chunks or not self.drafter_up:
            return []
        asks = []
        for s, n in plan.chunks.items():
            t = self.tracks[s]
            if t.on_drafter:
                feats, start = t.take_features()
                asks.append(ProposeRequest(s, tuple(t.unsent), 0, features=feats, features_start=start,
                                           prefill_tokens=n))
        return asks

    def _lagging(self, t: Track) -> bool:
        """Whether the drafter must catch up with this sequence before it drafts for it: it was
        re-added and has not computed it yet, or more than a step's catch-up went unsent
        (speculation was off a while)."""
        return t.catch_up or len(t.unsent) > CATCH_UP_TOKENS

    def _catch_up_pieces(self, ids: list[str], plan: _Plan) -> list[ProposeRequest]:
        """Lagging sequences' next pieces (k = 0, the chunked-prefill piece of ProposeRequest), at
        most CATCH_UP_TOKENS this step over all of them; the rest wait for later steps."""
        budget, asks = CATCH_UP_TOKENS, []
        for s in ids:
            t = self.tracks[s]
            if budget <= 0:
                break
            if not t.on_drafter or t.k <= 0 or s in plan.chunks or not self._lagging(t):
                continue
            n = min(budget, t.behind + len(t.unsent))
            feats, start = t.take_features()
            asks.append(ProposeRequest(s, tuple(t.unsent), 0, features=feats, features_start=start, prefill_tokens=n))
            budget -= n
        if asks:
            log.debug("drafter catch-up: %d pieces, %d tokens", len(asks), CATCH_UP_TOKENS - budget)
        return asks

    def _propose(self, reqs: list[ProposeRequest]) -> dict[str, Proposal]:
        if not reqs:
            return {}
        t0 = time.perf_counter()
        try:
            proposals = self.drafter.propose(reqs)
        except Exception as e:
            self._drafter_failed(e)
            return {}
        self._time_draft(reqs, time.perf_counter() - t0)
        for r in reqs:
            self.tracks[r.seq_id].unsent = []
        return self._received(reqs, proposals)

    def _received(self, asks: list[ProposeRequest], proposals) -> dict[str, Proposal]:
        """The drafter answered `asks` (just in time or pre-drafted): their sequences are in its KV
        now (what it computed of them), and its proposals that are safe to verify, by seq_id."""
        for a in asks:
            t = self.tracks.get(a.seq_id)
            if t is not None:
                # a draft computed everything before it; a piece up to prefill_tokens of it
                t.behind = 0 if a.k > 0 else max(0, t.behind + len(a.new_token_ids) - a.prefill_tokens)
                t.catch_up = t.catch_up and t.behind > 0
        return checked_proposals(asks, proposals, self.tracks, self.verifier.vocab_size, self._hold_now)

    # ---- phase 3: verify (and pre-draft the next step meanwhile) ----------------------------
    def _verify(self, reqs: list[VerifyRequest], proposals: dict[str, Proposal], plan: _Plan,
                stats: StepStats) -> tuple[list[VerifyResult], dict[str, Proposal], dict]:
        """The verifier's results (pending ones resolved), the pre-drafted branches by seq_id, and
        the prompt logprobs by seq_id (taken from the verify itself: they stand even when the step
        is resolved or abandoned after it, as the prompt's KV does)."""
        started = self._start_predraft(reqs, plan, stats) if self.predraft is not None and plan.k > 0 else None
        t0 = time.perf_counter()
        try:
            results = self.verifier.verify(reqs)
        except BaseException:
            # The pre-draft call is on the drafter's one client: wait for it (its deadline bounds
            # the wait) before anything else (the scheduler's release of every sequence) uses it.
            self._join_predraft(started)
            raise
        prompt_logprobs = {r.seq_id: r.prompt_logprobs for r in results if r.prompt_logprobs is not None}
        verified = time.perf_counter()
        self._time_verify(verified - t0, sum(len(r.draft_token_ids) + 1 for r in reqs))
        # a verify that computed prompt tokens is not a decode step: its time says nothing about
        # the table's (batch, rows) shapes
        if self.recalibration is not None and not plan.computes_prompt:
            self.recalibration.observe(len(reqs), max(len(r.draft_token_ids) + 1 for r in reqs), verified - t0)
        branches = self._join_predraft(started)
        stats.draft_wait_s += time.perf_counter() - verified
        results = self._resolve_pending(results, proposals)
        stats.verify_s = time.perf_counter() - t0
        return results, branches, prompt_logprobs

    def _start_predraft(self, reqs: list[VerifyRequest], plan: _Plan,
                        stats: StepStats) -> tuple[list[ProposeRequest], Future] | None:
        """Ask the drafter, on the pre-draft thread, for each speculating sequence's branch "all of
        this step's drafts accepted": 1 + k tokens after them (the bonus guess, then k drafts)."""
        asks = []
        for r in reqs:
            t = self.tracks[r.seq_id]
            k = self._k_for(t, plan, extra=len(r.draft_token_ids) + 1)
            if k <= 0:
                continue
            feats, start = t.take_features()
            asks.append(ProposeRequest(r.seq_id, tuple(t.unsent), 1 + k, r.draft_token_ids, pre_draft=True,
                                       features=feats, features_start=start))
        if not asks:
            return None
        for a in asks:
            self.tracks[a.seq_id].unsent = []
        stats.feature_rows += sum(a.features.shape[0] for a in asks if a.features is not None)
        self._set_deadline(asks)
        return asks, self.predraft.start(asks)

    def _join_predraft(self, started) -> dict[str, Proposal]:
        """Wait for the pre-draft call; its checked branches by seq_id (none if it failed)."""
        if started is None:
            return {}
        asks, future = started
        try:
            proposals = future.result()
        except Exception as e:
            self._drafter_failed(e)
            return {}
        return self._received(asks, proposals)

    # ---- phase 4: q rows (sampling) ----------------------------------------------------------
    def _resolve_pending(self, results: list[VerifyResult], proposals) -> list[VerifyResult]:
        pending = [r for r in results if r.pending_position is not None]
        sampled = any(claims_q(p) for p in proposals.values())
        if not pending and not sampled:
            return results
        # Rows of the rejected drafts, and of a few accepted ones whose claimed q(x) is audited.
        checked = {r.seq_id: r.pending_position for r in pending}
        audited = audit_positions(results, proposals, self._audit_rng.random, self.q_audit_rate)
        checked.update(audited)
        # The drafter counts chain positions from the last tokens it was sent: drafts of a branch
        # that came true sit behind that step's tokens, until the next propose sends them.
        fetch = [RowRequest(sid, len(self.tracks[sid].unsent) + j) for sid, j in checked.items()]
        if not self.drafter_up:  # it failed during this step's pre-draft: its q rows are lost
            return self._abandon_sampled(results, proposals, "the drafter was lost before it sent its q rows")
        self._set_deadline([])
        try:
            rows = self.drafter.fetch_rows(fetch)
        except Exception as e:
            self._drafter_failed(e)
            return self._abandon_sampled(results, proposals, "the drafter was lost before it sent its q rows")
        if not fetch:
            return results
        self.q_audits += len(audited)
        why = rows_problem(fetch, rows, self.verifier.vocab_size) or claims_problem(checked, rows, proposals)
        if why is not None:
            self._drafter_failed(ValueError(f"it sent unusable q rows: {why}"))
            return self._abandon_sampled(results, proposals, "the drafter's q rows were unusable")
        if not pending:
            return results
        resolved = {r.seq_id: r for r in self.verifier.resolve([q for q in rows if q.seq_id not in audited])}
        return [resolved.get(r.seq_id, r) for r in results]

    def _abandon_sampled(self, results: list[VerifyResult], proposals, why: str) -> list[VerifyResult]:
        """The exact fallback when a step's q rows are lost: every sampled sequence that had drafts
        in this step discards the step as a whole (the verifier rolls it back: no tokens, KV as
        before), whatever its outcome; the next step samples those positions again.

        Why not finish the pending ones some other way: a sequence left pending was rejected at
        position n, and its recovered token must come from normalize(max(0, p - q)), which needs
        q. Resolving with q one-hot at the rejected draft (what this replaced) is biased, and so is
        sampling position n from p: given a rejection there, that emits P(x) = min(p, q)(x) +
        (1 - beta) p(x) over both branches, not p(x). Keeping the accepted prefix and cutting at the
        rejection is biased too (the cut depends on the outcome). What is exact is a truncation
        point that does not depend on the outcome: here, the step's start, for every sampled
        sequence with drafts (which ones those are depends only on the request and on whether the
        drafter proposed, never on the verifier's draws). Conditioned on that, the kept tokens are
        exactly the ones before the step, and the next step (target-only while the drafter is
        down) samples the position from p. Re-using the position-keyed uniforms of the abandoned
        step is as good as fresh, because nothing kept depends on them (specsplit.sampling.rng).
        Greedy and coupled (seeded) sequences never need q rows: their results stand.
        """
        drop = {sid for sid, p in proposals.items()
                if p.token_ids and not self.tracks[sid].add.params.accepts_by_match}
        drop |= {r.seq_id for r in results if r.pending_position is not None}
        if not drop:
            return results
        log.warning("%s; %d sampled sequences discard this step (exact fallback) and resample it", why, len(drop))
        self.verifier.abandon(sorted(drop))
        # Their next step is target-only (whatever the drafter does), so each makes progress even
        # if the drafter keeps losing its rows; that choice, too, ignores the step's outcome.
        self._hold_next |= drop
        if self.predraft is not None:
            for sid in drop:
                self.predraft.ready.pop(sid, None)
        return [VerifyResult(r.seq_id, 0, ()) if r.seq_id in drop else r for r in results]

    # ---- phase 5: account ------------------------------------------------------------------
    def _account(self, reqs: list[VerifyRequest], results: list[VerifyResult], branches: dict[str, Proposal],
                 asked_drafter: bool, stats: StepStats, chunks: dict[str, int] | None = None) -> StepOutput:
        """Emitted tokens into each track (and, for the drafter, its unsent tokens and features),
        acceptance per sequence and per position, branch hits and misses, prefill progress."""
        out: dict[str, list[int]] = {}
        drafts: dict[str, tuple[int, int]] = {}
        logprobs: dict[str, tuple[TokenLogprob, ...]] = {}
        stats.accepted_per_position = [0] * max((len(r.draft_token_ids) for r in reqs), default=0)
        for req, res in zip(reqs, results):
            track = self.tracks[res.seq_id]
            emitted = list(res.token_ids)
            out[res.seq_id] = emitted
            if res.logprobs is not None:
                logprobs[res.seq_id] = res.logprobs
            track.tokens.extend(emitted)
            piece = bool(chunks) and res.seq_id in chunks  # its features go with the next piece (_prefill_pieces)
            if emitted:  # the prompt is in the verifier's KV (its last piece, or the whole of it)
                track.prefill_left = 0
            elif piece:
                track.prefill_left -= chunks[res.seq_id]
            if track.on_drafter:
                track.unsent.extend(emitted)
                if res.features is not None and res.features.shape[0]:
                    track.add_features(res.features_start, res.features,
                                       MAX_FEATURE_ROWS if asked_drafter or piece else IDLE_FEATURE_ROWS)
            drafts[res.seq_id] = (len(req.draft_token_ids), res.num_accepted)
            depth = len(req.draft_token_ids)
            if req.draft_parents is not None:  # a tree: acceptance is of its depth; what branches gained
                tree = DraftTree(req.draft_token_ids, req.draft_parents)
                depth, chain = tree.depth, tree.main_chain
                along = next((j for j in range(min(chain, len(emitted))) if emitted[j] != tree.tokens[j]), min(chain, len(emitted)))
                self.tree_value.update(len(tree) - chain, res.num_accepted - min(along, res.num_accepted))
                stats.tree_nodes += len(tree) - chain
            if req.draft_token_ids or track.asked:  # asked and drafted fewer (or none): counted too
                track.acceptance.update(depth, res.num_accepted, asked=track.asked)
                self.pooled.update(depth, res.num_accepted, asked=track.asked)
            track.asked = 0
            stats.proposed += len(req.draft_token_ids)
            stats.accepted += res.num_accepted
            for j in range(res.num_accepted):
                stats.accepted_per_position[j] += 1
            branch = branches.get(res.seq_id)
            if branch is not None:
                stats.branches += 1
                if track.on_drafter and self.predraft.came_true(req, emitted, branch):
                    stats.branch_hits += 1
                else:
                    stats.branch_misses += 1
        self.branch_hits += stats.branch_hits
        self.branch_misses += stats.branch_misses
        return StepOutput(out, stats, False, drafts, logprobs=logprobs)

    # ---- the drafter's deadline ------------------------------------------------------------
    def _time_verify(self, seconds: float, tokens: int) -> None:
        per_token = seconds / max(1, tokens)
        if self._verify_s is None:
            self._verify_s, self._verify_token_s = seconds, per_token
        else:
            self._verify_s += _EMA * (seconds - self._verify_s)
            self._verify_token_s += _EMA * (per_token - self._verify_token_s)

    def _set_deadline(self, asks: Sequence[ProposeRequest]) -> None:
        """The deadline of the drafter's next call (None until a verify has been timed). A step's
        own few tokens (the last emitted ones, the drafts being verified) are in the verify time
        already; only what comes on top is allowed for per token: a piece (at most a prompt piece
        or CATCH_UP_TOKENS), what the drafter has not computed of a sequence (`behind`: a prompt it
        was not given in pieces), tokens left unsent past a step's worth."""
        if self._verify_s is None or self.drafter is None:
            return
        step_tokens = self.spec.num_speculative_tokens + 1
        ingest = 0
        for a in asks:
            t = self.tracks[a.seq_id]
            ingest += max(0, len(a.new_token_ids) - step_tokens)
            ingest += a.prefill_tokens or t.behind
        per_token = self._draft_token_s if self._draft_token_s is not None else self._verify_token_s
        self.drafter.deadline_s = (max(DRAFT_DEADLINE_FLOOR_S, DRAFT_DEADLINE_FACTOR * self._verify_s)
                                   + ingest * per_token)

    def _time_draft(self, asks: Sequence[ProposeRequest], seconds: float) -> None:
        """The drafter's own seconds per token it computed (an average of its answered just-in-time
        calls): what the deadline allows per token of a piece or a prompt (a drafter's tokens cost
        what its model costs, not what the target's do)."""
        tokens = sum(len(a.new_token_ids) + len(a.pending_drafts) + a.k + a.prefill_tokens
                     + (self.tracks[a.seq_id].behind if a.seq_id in self.tracks and a.k > 0 else 0) for a in asks)
        per_token = seconds / max(1, tokens)
        if self._draft_token_s is None:
            self._draft_token_s = per_token
        else:
            self._draft_token_s += _EMA * (per_token - self._draft_token_s)

    # ---- drafter health --------------------------------------------------------------------
    def _drafter_failed(self, error: Exception) -> None:
        self.health.failed(error, self.tracks)
        if self.predraft is not None:
            self.predraft.ready.clear()
