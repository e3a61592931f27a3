"""The speculative step over the Drafter and Verifier protocols.

    propose (drafter) -> verify (target, rejection sampler) -> [fetch_rows + resolve, sampling only]

Asynchronous pre-drafting (`async_draft`, the default in split mode): while the verifier verifies
step t's drafts D, the drafter drafts the branch "every draft of D accepted": its guess b of the
bonus token, then K drafts after D + b. When the step emits exactly D + b (a hit) those K drafts
are step t+1's and the step starts verifying at once; otherwise (a miss) the drafter drafts just
in time, as in lockstep. Lossless by construction: a branch's drafts (and q(x), q rows) are drawn
from q given that branch's prefix, and used only when the emitted tokens equal it; whether they
are used depends on b and the verifier's draws, never on the branch's own draws (the keyed random
numbers of the positions after b are used by nothing else). Hits, misses, branches and the
seconds the verifier waited for drafts are counted in StepStats.

The step never knows whether it talks to in-process engines or gRPC clients. It keeps, per
sequence, only what the protocol needs: the tokens the drafter has not been told about yet
(deltas; after speculation was off for a while, several steps' worth) and the full token list so
a restarted drafter can be given the sequence again. Nothing per step (probabilities, hidden
states) is kept here: q rows live on the drafter with its chain of drafts (specsplit.engine), p
rows on the verifier until resolve.

Speculation is off for a step when the batch is larger than `disable_by_batch_size`, when a
request asked for none, or while the drafter is unreachable (then every stream goes on
target-only, with the same greedy tokens, and the drafter is re-synced when it answers again).
"""
from __future__ import annotations

import logging
import math
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Sequence

import torch

from specsplit.calibration import StepCosts
from specsplit.config import SpecConfig, step_k_cap
from specsplit.k_policy import Acceptance, KPolicy
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

log = logging.getLogger(__name__)

MAX_FEATURE_ROWS = 2048  # per sequence, waiting for the drafter (a long prompt's prefill fits)
IDLE_FEATURE_ROWS = 64  # ... after a step that did not ask the drafter (speculation off)


@dataclass
class _Track:
    add: SeqAdd
    k: int  # speculative tokens for this request (0 = none)
    tokens: list[int]  # prompt + every emitted token
    unsent: list[int] = field(default_factory=list)  # emitted, not yet sent to the drafter
    on_drafter: bool = False
    acceptance: Acceptance = field(default_factory=Acceptance)  # per position, for the K policy
    # Feature drafters: the target's features [rows, F] of positions feat_start.., committed since
    # the drafter last heard; sent with `unsent`. Bounded (MAX_FEATURE_ROWS, newest kept): while
    # speculation is off nothing grows past it, and the drafter skips a gap it never saw.
    feats: torch.Tensor | None = None
    feat_start: int = 0

    def add_features(self, start: int, rows: torch.Tensor, cap: int) -> None:
        rows = rows.to(torch.bfloat16)  # what crosses the wire too, and what the head was trained on
        if self.feats is not None and start == self.feat_start + self.feats.shape[0]:
            start, rows = self.feat_start, torch.cat([self.feats, rows])
        drop = max(0, rows.shape[0] - cap)
        self.feats, self.feat_start = rows[drop:], start + drop

    def take_features(self) -> tuple[torch.Tensor | None, int]:
        out = (self.feats, self.feat_start)
        self.feats = None
        return out


@dataclass
class StepOutput:
    tokens: dict[str, list[int]]  # seq_id -> tokens emitted this step
    stats: StepStats
    speculated: bool
    drafts: dict[str, tuple[int, int]] = field(default_factory=dict)  # seq_id -> (proposed, accepted)
    k: int = 0  # drafts asked per sequence this step (the K policy's choice, or the fixed K)
    # seq_id -> one TokenLogprob per token in tokens[seq_id], for the sequences that asked
    logprobs: dict[str, tuple[TokenLogprob, ...]] = field(default_factory=dict)


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
        self.drafter = drafter
        self.spec = spec
        self.max_model_len = max_model_len
        self.drafter_retry_s = drafter_retry_s
        self._clock = clock
        self._drafter_down_since: float | None = None
        self._next_drafter_try = 0.0
        self._drafter_stale: set[str] = set()  # may still be on the drafter since it failed
        self._hold_next: set[str] = set()  # abandoned this step: target-only next step
        self._hold_now: set[str] = set()  # abandoned last step: no proposal verified this step
        self.tracks: dict[str, _Track] = {}
        self.async_draft = spec.async_draft and drafter is not None
        self._ready: dict[str, Proposal] = {}  # next step's drafts of the branches that came true
        self._pool: ThreadPoolExecutor | None = None  # the thread that calls the drafter while the verifier runs
        self.branch_hits = 0
        self.branch_misses = 0
        self.policy: KPolicy | None = None
        self.k_chosen: Counter[int] = Counter()  # steps per K drafted (0: speculation off that step)
        self._probes = 0  # probe steps so far: which sequence drafts in the next one
        if costs is not None and costs.verify and spec.k_policy == "auto":
            # A hybrid's model drafts at most model_tokens a step (0: all k, as a feature drafter does)
            hybrid = drafter.model_tokens or None if drafter is not None else None
            self.policy = KPolicy(costs, spec.num_speculative_tokens, hybrid, async_draft=self.async_draft)

    # ---- lifecycle -----------------------------------------------------------------------
    @property
    def feature_layers(self) -> tuple[int, ...]:
        """Target layers a feature drafter reads (the verifier returns them with each step)."""
        return tuple(self.drafter.feature_layers) if self.drafter is not None else ()

    @property
    def drafter_up(self) -> bool:
        return self.drafter is not None and self._drafter_down_since is None

    def add(self, seq: SeqAdd, num_speculative_tokens: int | None = None, disable: bool = False) -> None:
        """Add to the verifier (errors propagate: nothing is kept) and, best effort, the drafter."""
        if seq.seq_id in self.tracks:
            raise ValueError(f"sequence {seq.seq_id!r} is already running")
        k = 0 if disable else (self.spec.num_speculative_tokens if not num_speculative_tokens else num_speculative_tokens)
        layers = self.feature_layers if k > 0 else ()
        self.verifier.add([replace(seq, feature_layers=layers)] if layers else [seq])
        track = _Track(add=seq, k=k, tokens=list(seq.prompt_token_ids))
        self.tracks[seq.seq_id] = track
        if self.drafter_up and k > 0:
            try:
                self.drafter.add([seq])
                track.on_drafter = True
            except Exception as e:  # the drafter is optional: never fail a request because of it
                self._drafter_failed(e)

    def release(self, seq_ids: Sequence[str]) -> None:
        ids = [s for s in seq_ids if s in self.tracks]
        on_drafter = [s for s in ids if self.tracks[s].on_drafter]
        for s in ids:
            del self.tracks[s]
            self._ready.pop(s, None)
        if ids:
            self.verifier.release(ids)
        if on_drafter and self.drafter_up:
            try:
                self.drafter.release(on_drafter)
            except Exception as e:
                self._drafter_failed(e)

    # ---- the step ------------------------------------------------------------------------
    def step(self, budgets: dict[str, int] | None = None) -> StepOutput:
        """One step for every running sequence. budgets: tokens each may still emit (caps k)."""
        stats = StepStats()
        ids = list(self.tracks)
        if not ids:
            return StepOutput({}, stats, False)
        budgets = budgets or {}
        self._maybe_resync_drafter()
        speculate = self.drafter_up and self.spec.enabled_for(len(ids))
        proposals: dict[str, Proposal] = {}
        k_step = 0
        only = None
        if speculate:
            k_step, only = self._choose_k(ids)
            speculate = k_step > 0
        self.k_chosen[k_step] += 1
        ready, self._ready = self._ready, {}
        if speculate:
            proposals = self._take_ready(ready, budgets, k_step, only)
            asks = self._propose_requests([s for s in ids if s not in proposals], budgets, k_step, only)
            stats.feature_rows += sum(a.features.shape[0] for a in asks if a.features is not None)
            t0 = time.perf_counter()
            proposals.update(self._propose(asks))
            stats.draft_s = time.perf_counter() - t0
            if self.async_draft and asks:
                stats.draft_wait_s = stats.draft_s  # drafted just in time: the verifier waited
            speculate = bool(proposals)

        reqs = []
        for s in ids:
            p = proposals.get(s)
            if p is not None and p.token_ids:
                reqs.append(VerifyRequest(s, p.token_ids, p.probs))
            else:
                reqs.append(VerifyRequest(s))
        asked_drafter = speculate
        branches = self._start_predraft(reqs, budgets, k_step, only) if self.async_draft and k_step > 0 else None
        if branches is not None:
            stats.feature_rows += sum(a.features.shape[0] for a in branches[0] if a.features is not None)
        t0 = time.perf_counter()
        results = self.verifier.verify(reqs)
        verified = time.perf_counter()
        predrafts = self._join_predraft(branches)
        stats.draft_wait_s += time.perf_counter() - verified
        results = self._resolve_pending(results, proposals)
        stats.verify_s = time.perf_counter() - t0

        out: dict[str, list[int]] = {}
        drafts: dict[str, tuple[int, int]] = {}
        logprobs: dict[str, tuple[TokenLogprob, ...]] = {}
        k_max = max((len(r.draft_token_ids) for r in reqs), default=0)
        stats.accepted_per_position = [0] * k_max
        for req, res in zip(reqs, results):
            track = self.tracks[res.seq_id]
            emitted = list(res.token_ids)
            out[res.seq_id] = emitted
            if res.logprobs is not None:
                logprobs[res.seq_id] = res.logprobs
            track.tokens.extend(emitted)
            if track.on_drafter:
                track.unsent.extend(emitted)
                if res.features is not None and res.features.shape[0]:
                    track.add_features(res.features_start, res.features,
                                       MAX_FEATURE_ROWS if asked_drafter else IDLE_FEATURE_ROWS)
            drafts[res.seq_id] = (len(req.draft_token_ids), res.num_accepted)
            if req.draft_token_ids:
                track.acceptance.update(len(req.draft_token_ids), res.num_accepted)
            stats.proposed += len(req.draft_token_ids)
            stats.accepted += res.num_accepted
            for j in range(res.num_accepted):
                stats.accepted_per_position[j] += 1
            branch = predrafts.get(res.seq_id)
            if branch is not None:
                stats.branches += 1
                if self._branch_came_true(req, emitted, branch):
                    stats.branch_hits += 1
                else:
                    stats.branch_misses += 1
        self.branch_hits += stats.branch_hits
        self.branch_misses += stats.branch_misses
        return StepOutput(out, stats, speculate, drafts, k_step if speculate else 0, logprobs=logprobs)

    # ---- asynchronous pre-drafting -------------------------------------------------------
    def _take_ready(self, ready: dict[str, Proposal], budgets: dict[str, int], k_step: int, only: str | None) -> dict:
        """The pre-drafted proposals this step uses, cut to the k each sequence may draft now."""
        out = {}
        for s, p in ready.items():
            t = self.tracks.get(s)
            if t is None or not t.on_drafter or s in self._hold_now or (only is not None and s != only):
                continue
            k = self._k_for(t, budgets.get(s), k_step, extra=0)
            if k > 0:
                out[s] = Proposal(s, p.token_ids[:k], None if p.probs is None else p.probs[:k])
        return out

    def _k_for(self, t: _Track, budget: int | None, k_step: int, extra: int) -> int:
        """Drafts a sequence may verify in a step that starts `extra` tokens from now."""
        return step_k_cap(min(t.k, k_step), len(t.tokens) + extra, self.max_model_len,
                          None if budget is None else budget - extra)

    def _start_predraft(self, reqs: list[VerifyRequest], budgets: dict[str, int], k_step: int,
                        only: str | None) -> tuple[list[ProposeRequest], Future] | None:
        """Ask the drafter, on the pre-draft thread, for each speculating sequence's branch "all of
        this step's drafts accepted": 1 + k tokens after them (the bonus guess, then k drafts)."""
        asks = []
        for r in reqs:
            t = self.tracks[r.seq_id]
            if not t.on_drafter or t.k <= 0 or r.seq_id in self._hold_now or (only is not None and r.seq_id != only):
                continue
            k = self._k_for(t, budgets.get(r.seq_id), k_step, extra=len(r.draft_token_ids) + 1)
            if k <= 0:
                continue
            feats, start = t.take_features()
            asks.append(ProposeRequest(r.seq_id, tuple(t.unsent), 1 + k, r.draft_token_ids, pre_draft=True,
                                       features=feats, features_start=start))
        if not asks:
            return None
        for a in asks:
            self.tracks[a.seq_id].unsent = []
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="predraft")
        return asks, self._pool.submit(self.drafter.propose, asks)

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
        return self._checked_proposals(asks, proposals)

    def _branch_came_true(self, req: VerifyRequest, emitted: list[int], branch: Proposal) -> bool:
        """Whether the step emitted the branch's prefix (every draft, then the guessed bonus); if
        so, keep the branch's remaining drafts for the next step."""
        track = self.tracks[req.seq_id]
        if not track.on_drafter or len(branch.token_ids) < 2:
            return False
        if tuple(emitted) != tuple(req.draft_token_ids) + branch.token_ids[:1]:
            return False
        self._ready[req.seq_id] = Proposal(req.seq_id, branch.token_ids[1:],
                                           None if branch.probs is None else branch.probs[1:])
        return True

    def _choose_k(self, ids: list[str]) -> tuple[int, str | None]:
        """The K of this step (the policy's over the sequences that speculate, else the fixed K),
        and the one sequence that drafts when the policy probes (None: every sequence)."""
        live = [s for s in ids if self.tracks[s].on_drafter and self.tracks[s].k > 0]
        if not live:
            return 0, None
        if self.policy is None:
            return max(self.tracks[s].k for s in live), None
        self.policy.model_fraction = float(self.drafter.model_share)
        # Sequences that do not speculate still take a row in the verify forward.
        others = [Acceptance(prior_rate=0.0, prior_weight=1.0)] * (len(ids) - len(live))
        k = self.policy.choose([self.tracks[s].acceptance for s in live] + others,
                               [self.tracks[s].k for s in live] + [0] * len(others))
        if not self.policy.probing:
            return k, None
        self._probes += 1
        return k, live[self._probes % len(live)]

    def _propose_requests(self, ids: list[str], budgets: dict[str, int], k_step: int,
                          only: str | None = None) -> list[ProposeRequest]:
        reqs = []
        for s in ids:
            t = self.tracks[s]
            if not t.on_drafter or t.k <= 0 or (only is not None and s != only):
                continue
            k = self._k_for(t, budgets.get(s), k_step, extra=0)
            if k <= 0:
                continue
            feats, start = t.take_features()
            reqs.append(ProposeRequest(s, tuple(t.unsent), k, features=feats, features_start=start))
        return reqs

    def _propose(self, reqs: list[ProposeRequest]) -> dict[str, Proposal]:
        if not reqs:
            return {}
        try:
            proposals = self.drafter.propose(reqs)
        except Exception as e:
            self._drafter_failed(e)
            return {}
        for r in reqs:
            self.tracks[r.seq_id].unsent = []
        return self._checked_proposals(reqs, proposals)

    def _checked_proposals(self, reqs: list[ProposeRequest], proposals) -> dict:
        """The drafter's proposals that are safe to verify, by seq_id. A proposal is dropped (its
        sequence decodes target-only this step, and the drafter catches up next step) when it
        answers no request of ours, drafts more than the k asked for, has an id outside the
        vocabulary, or -- for a sampled sequence -- lacks a q(x) per draft or has one that is not
        a finite number in (0, 1]. A peer's bad answer never reaches the verifier, so it can
        neither fail the stream nor any other stream."""
        asked = {r.seq_id: r.k for r in reqs}
        vocab = self.verifier.vocab_size
        out = {}
        for p in proposals:
            if p.seq_id in self._hold_now:  # its last step was abandoned: one step target-only
                continue
            why = _proposal_problem(p, asked, vocab, self.tracks)
            if why is None:
                out[p.seq_id] = p
            else:
                log.warning("drafter proposal for %r refused (%s); that sequence decodes target-only this step",
                            p.seq_id, why)
        return out

    def _resolve_pending(self, results: list[VerifyResult], proposals) -> list[VerifyResult]:
        pending = [r for r in results if r.pending_position is not None]
        sampled = any(p.probs is not None and any(q != 1.0 for q in p.probs) for p in proposals.values())
        if not pending and not sampled:
            return results
        # The drafter counts chain positions from the last tokens it was sent: drafts of a branch
        # that came true sit behind that step's tokens, until the next propose sends them.
        fetch = [RowRequest(r.seq_id, len(self.tracks[r.seq_id].unsent) + r.pending_position) for r in pending]
        if not self.drafter_up:  # it failed during this step's pre-draft: its q rows are lost
            return self._abandon_sampled(results, proposals, "the drafter was lost before it sent its q rows")
        try:
            rows = self.drafter.fetch_rows(fetch)
        except Exception as e:
            self._drafter_failed(e)
            return self._abandon_sampled(results, proposals, "the drafter was lost before it sent its q rows")
        if not pending:
            return results
        why = _rows_problem(fetch, rows, self.verifier.vocab_size)
        if why is not None:
            self._drafter_failed(ValueError(f"it sent unusable q rows: {why}"))
            return self._abandon_sampled(results, proposals, "the drafter's q rows were unusable")
        resolved = {r.seq_id: r for r in self.verifier.resolve(rows)}
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
        for sid in drop:
            self._ready.pop(sid, None)
        return [VerifyResult(r.seq_id, 0, ()) if r.seq_id in drop else r for r in results]

    # ---- drafter health ------------------------------------------------------------------
    def _drafter_failed(self, error: Exception) -> None:
        if self._drafter_down_since is None:
            log.warning("drafter failed (%s); continuing target-only, retrying every %.1fs", error, self.drafter_retry_s)
            self._drafter_down_since = self._clock()
        self._next_drafter_try = self._clock() + self.drafter_retry_s
        for t in self.tracks.values():
            if t.on_drafter:
                # A failed call may have failed only for us (a timeout, one bad reply): the drafter
                # may still hold the sequence. Remember it, so it is released there on re-sync even
                # if it finishes while the drafter is down.
                self._drafter_stale.add(t.add.seq_id)
            t.on_drafter = False
            t.unsent = []
            t.feats = None
        self._ready.clear()

    def _maybe_resync_drafter(self) -> None:
        """After a drafter failure, give it every running sequence again once it answers.
        (Called at the start of every step: it also moves the abandoned sequences' hold on.)"""
        self._hold_now, self._hold_next = self._hold_next, set()
        if self.drafter is None or self._drafter_down_since is None or self._clock() < self._next_drafter_try:
            return
        want = [t for t in self.tracks.values() if t.k > 0]
        # Release what it may still hold: the sequences to re-add, and those that finished while it
        # was down (their release was never sent).
        stale = sorted(self._drafter_stale | {t.add.seq_id for t in want})
        try:
            self.drafter.release(stale)
            self._drafter_stale.clear()
            self.drafter.add([SeqAdd(t.add.seq_id, tuple(t.tokens), t.add.params) for t in want])
        except Exception as e:
            self._next_drafter_try = self._clock() + self.drafter_retry_s
            log.debug("drafter still unavailable: %s", e)
            return
        down = self._clock() - self._drafter_down_since
        log.info("drafter is back after %.1fs; re-synced %d sequences, speculation resumes", down, len(want))
        self._drafter_down_since = None
        for t in want:
            t.on_drafter = True
            t.unsent = []


def _proposal_problem(p, asked: dict[str, int], vocab: int | None, tracks: dict[str, _Track]) -> str | None:
    """Why a drafter's proposal cannot be verified, or None."""
    if p.seq_id not in asked:
        return "no such request in this step"
    n, k = len(p.token_ids), asked[p.seq_id]
    if n > k:
        return f"{n} drafts, asked for {k}"
    if vocab is not None:
        bad = [t for t in p.token_ids if not 0 <= t < vocab]
        if bad:
            return f"token ids {bad[:3]} outside the vocabulary [0, {vocab})"
    params = tracks[p.seq_id].add.params
    if p.probs is not None or not params.accepts_by_match:
        if n and (p.probs is None or len(p.probs) != n) and not params.coupled:
            return f"{0 if p.probs is None else len(p.probs)} q(x) values for {n} drafts"
        if p.probs is not None and not all(math.isfinite(q) and 0.0 < q <= 1.0 for q in p.probs):
            return "q(x) values not all finite numbers in (0, 1]"
    return None


def _rows_problem(fetch: list[RowRequest], rows, vocab: int | None) -> str | None:
    """Why fetch_rows's rows cannot resolve the pending sequences, or None."""
    if sorted(r.seq_id for r in rows) != sorted(f.seq_id for f in fetch):
        return f"rows for {sorted(r.seq_id for r in rows)[:3]}, asked for {sorted(f.seq_id for f in fetch)[:3]}"
    for r in rows:
        row = r.row
        if row.dim() != 1 or (vocab is not None and row.shape[0] != vocab):
            return f"q row of shape {tuple(row.shape)} for {r.seq_id!r}"
        if not bool(torch.isfinite(row).all()) or bool((row < 0).any()) or not float(row.sum()) > 0.0:
            return f"q row for {r.seq_id!r} is not a distribution"
    return None
