"""The one scheduler: continuous batching over a SpecDecoder, with KV-aware admission and
preemption. `specsplit generate`, `specsplit bench` and the gateway all run it.

    submit -> waiting -> (admit when both caches hold it) -> running -> step ... -> finished
                              ^                                    |
                              +---- preempted (newest first) <-----+   when blocks run out

Each step every running sequence may grow by its tokens plus the k lookahead drafts the verifier
scores (the drafter needs one slot fewer). Before a step the scheduler checks, per KV cache (the
verifier's and the drafter's, each with its own block size and block count), that the running
sequences fit; if not it preempts the newest ones: releases them on both engines and puts them back
at the front of the queue with their output kept. On resume the engines get prompt + output as
the prompt and recompute its KV; the stream goes on where it stopped (no token lost or repeated,
greedy output unchanged). A request is admitted only when it fits next to the running ones with a
block of headroom each (so it is not preempted at once); a request that could not fit even alone
(prompt + max_tokens beyond a whole cache) is refused at submit.

Chunked prefill (`max_num_batched_tokens`, vLLM's knob of that name): each step computes at most
that many tokens on the verifier. The running sequences' decodes (k + 1 each) come first; the rest
of the budget (at least a quarter of it, so prompts always progress) goes to prompts not yet in
the KV, oldest first, in pieces. A sequence emits nothing until the step that computes its last
piece; running streams keep their pace while long prompts arrive. None: every prompt is computed
whole in its first step (the CLI's single request, the bench's batches).

Threads: `step` runs on one thread (the step thread); `submit`, `abort` and `abort_all` may be
called from any thread. An abort ends the stream at once, even while the step thread waits on an
engine; the step thread releases the sequence on the engines after that step.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from specsplit.config import drafter_reach, step_k_cap
from specsplit.engine import culprit
from specsplit.kv.prefix_view import PrefixView, shared_blocks
from specsplit.request import (
    Event,
    GenerationRequest,
    Limits,
    Request,
    RequestError,
    error_from_exception,
    validate,
    with_min_tokens_stops,
)
from specsplit.spec import SpecDecoder

log = logging.getLogger(__name__)


def _label(req: Request, seq_id: str) -> str:
    """How logs name a request: the caller's id (if any) and the engines' id."""
    return f"{req.request_id!r} ({seq_id})" if req.request_id else seq_id


@dataclass(frozen=True)
class KvBudget:
    """One engine's paged KV cache, as the scheduler accounts for it."""

    name: str  # "verifier" | "drafter"
    num_blocks: int
    block_size: int
    prefix_caching: bool = False  # full prompt blocks computed for one sequence are reused by others

    def blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size


def kv_budgets_of(decoder: SpecDecoder) -> list[KvBudget]:
    """The paged caches of in-process engines (gRPC clients have none: pass their ServiceInfo's)."""
    out = []
    for name, engine in (("verifier", decoder.verifier), ("drafter", decoder.drafter)):
        bm = engine.block_manager if engine is not None else None
        if bm is not None:
            out.append(KvBudget(name, bm.num_blocks, bm.block_size, bool(getattr(bm, "prefix_caching", False))))
    return out


class Observer:
    """Hooks for metrics (the gateway counts with Prometheus). May be called from any thread."""

    def on_admit(self, request: Request, resumed: bool) -> None: ...

    def on_step(self, out, seconds: float) -> None: ...

    def on_tokens(self, request: Request, kept: list[int]) -> None: ...

    def on_preempt(self, request: Request) -> None: ...

    def on_finish(self, request: Request, outcome: str) -> None: ...


class Scheduler:
    def __init__(
        self,
        decoder: SpecDecoder,
        eos_token_ids: Iterable[int],
        max_num_seqs: int = 32,
        max_queue: int | None = None,
        kv: Sequence[KvBudget] | None = None,
        limits: Limits | None = None,
        decode: Callable[[list[int]], str] | None = None,
        observer: Observer | None = None,
        classify: Callable[[BaseException], RequestError] = error_from_exception,
        max_num_batched_tokens: int | None = None,
    ):
        if max_num_batched_tokens is not None and max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens must be positive, got {max_num_batched_tokens}")
        self.decoder = decoder
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_num_seqs = max_num_seqs
        self.max_queue = max_queue  # None: unbounded (the CLI and the bench)
        self.kv = list(kv_budgets_of(decoder) if kv is None else kv)
        if limits is None:
            vocab = decoder.verifier.vocab_size
            limits = Limits(vocab, decoder.max_model_len) if vocab else None
        self.limits = limits
        self.decode = decode
        self.observer = observer or Observer()
        self.classify = classify
        self.waiting: deque[Request] = deque()
        self.running: dict[str, Request] = {}  # seq_id -> request, in admission order
        self.steps = 0
        self.speculative_steps = 0
        self.preemptions = 0
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # waiting, _live
        self._live: dict[str, Request] = {}  # seq ids of unfinished requests (any thread reads)
        self._work = threading.Event()
        self._prefix_waits: set[str] = set()  # waiting requests whose wait for another's prompt was logged
        self._registered: set[str] = set()  # running requests whose prompt's blocks the verifier has registered
        verifier = next((b for b in self.kv if b.name == "verifier" and b.prefix_caching), None)
        # what the verifier's prefix cache holds, as far as this scheduler saw it fill (None: no cache)
        self.prefix_view = PrefixView(verifier.block_size, verifier.num_blocks) if verifier is not None else None

    # ---- any thread ----------------------------------------------------------------------
    @property
    def inflight(self) -> int:
        with self._lock:
            return len(self._live)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def submit(self, request: GenerationRequest, sink: Callable[[Event], None] | None = None) -> Request:
        """Validate and queue; RequestError(invalid_argument | resource_exhausted) otherwise."""
        validate(request, self.limits)
        request = with_min_tokens_stops(request, self.eos_token_ids)
        target_only = self._check_fits(request)
        with self._lock:
            if self.max_queue is not None and len(self._live) >= self.max_num_seqs + self.max_queue:
                raise RequestError(
                    RequestError.EXHAUSTED,
                    f"the server is full: {len(self._live)} requests running or queued "
                    f"(max_num_seqs {self.max_num_seqs} + max_queue {self.max_queue}); retry later",
                )
            n = next(self._ids)
            req = Request(request, f"r{n}", n, self.decode, sink)
            req.target_only = target_only
            self._live[req.seq_id] = req
            self.waiting.append(req)
        if target_only is not None:
            log.info("request %s: %s; it decodes target-only, the others speculate", _label(req, req.seq_id),
                     target_only)
        self._work.set()
        return req

    def abort(self, request: Request, reason: str = "cancelled", error: RequestError | None = None) -> None:
        """End a request now (client cancel, deadline, drain); the step thread frees its KV."""
        self._finish(request, "abort", outcome=reason, error=error)
        self._work.set()

    def abort_all(self, reason: str = "abort", error: RequestError | None = None) -> int:
        with self._lock:
            live = list(self._live.values())
        for req in live:
            self.abort(req, reason, error)
        return len(live)

    def wait_for_work(self, timeout: float) -> None:
        """Block the step thread until something is submitted or aborted (or timeout)."""
        if not self.has_work:
            self._work.wait(timeout)
        self._work.clear()

    def _check_fits(self, request: GenerationRequest) -> str | None:
        """INVALID_ARGUMENT for a request no whole verifier cache could hold. One the drafter's whole
        cache cannot hold is served target-only instead (the drafter is optional; it never takes
        the drafter's cache): the reason, or None."""
        need = len(request.prompt_token_ids) + request.max_tokens
        why = None
        for b in self.kv:
            if b.blocks(need) <= b.num_blocks:
                continue
            what = (f"prompt ({len(request.prompt_token_ids)} tokens) + max_tokens ({request.max_tokens}) = {need} "
                    f"tokens can never fit: the {b.name}'s whole KV cache holds {b.num_tokens} tokens "
                    f"({b.num_blocks} blocks of {b.block_size})")
            if b.name == "drafter":
                why = what if self._may_draft(request) else None
                continue
            raise RequestError(RequestError.INVALID, f"{what}; shorten the prompt or lower max_tokens")
        return why

    def _finish(self, req: Request, reason: str | None = None, tokens: list[int] | None = None,
                error: RequestError | None = None, outcome: str | None = None) -> None:
        if req.finish(reason, tokens, error):
            with self._lock:
                self._live.pop(req.seq_id, None)
            self.observer.on_finish(req, error.kind if error is not None else (outcome or req.finish_reason or "abort"))

    # ---- the step thread -----------------------------------------------------------------
    def step(self) -> list[tuple[Request, list[int]]]:
        """Admit, preempt, run one step; returns (request, tokens kept) for every running one."""
        self._sweep()
        self._make_room()
        self._admit()
        if not self.running:
            return []
        budgets = {sid: req.budget for sid, req in self.running.items()}
        prefill = self._plan_prefill()
        # prompts computed before this step: its verify registers their blocks for reuse (_prefix_wait)
        computed = [] if self.prefix_view is None else [
            sid for sid in self.running if (t := self.decoder.tracks.get(sid)) is not None and not t.prefill_left]
        t0 = time.perf_counter()
        try:
            out = self.decoder.step(budgets, prefill)
        except Exception as e:
            self._step_failed(e)
            return []
        if self.prefix_view is not None:
            for sid in computed:
                if sid not in self._registered and sid in self.running:
                    self.prefix_view.remember(self.running[sid].request.prompt_token_ids)
            self._registered = (self._registered | set(computed)) & set(self.running)
        self.steps += 1
        self.speculative_steps += int(out.speculated)
        self.observer.on_step(out, time.perf_counter() - t0)
        events = []
        done = []
        for sid, tokens in out.tokens.items():
            req = self.running[sid]
            proposed, accepted = out.drafts.get(sid, (0, 0))
            req.count_drafts(proposed, accepted)
            if req.closed:  # aborted while the step ran
                done.append(sid)
                continue
            prompt = out.prompt_logprobs.get(sid)
            if prompt is not None:
                req.take_prompt_logprobs(prompt)
            if req.wants_prompt_logprobs and tokens:
                # Asked for, not given: a verifier older than the prompt_logprobs field (it ignores it).
                done.append(sid)
                self._finish(req, error=RequestError(
                    "unimplemented", "the verifier did not score the prompt for this request (a verifier service "
                    "older than GenerateRequest.prompt_logprobs?); upgrade it or send the request without "
                    "prompt_logprobs / echo"))
                continue
            logprobs = out.logprobs.get(sid)
            if req.logprobs is not None and tokens and (logprobs is None or len(logprobs) != len(tokens)):
                # Asked for, not given: a verifier older than the logprobs field (it ignores it).
                done.append(sid)
                self._finish(req, error=RequestError(
                    "unimplemented", "the verifier returned no logprobs for this request (a verifier service "
                    "older than GenerateRequest.logprobs?); upgrade it or send the request without logprobs"))
                continue
            kept = req.take(tokens, self.eos_token_ids, logprobs)
            self.observer.on_tokens(req, kept)
            events.append((req, kept))
            if req.finished:
                done.append(sid)
                self._finish(req, req.finish_reason, kept)
            elif kept:
                req.emit(kept)
        if done:
            ended = [sid for sid in done if self.running[sid].finish_reason in ("stop", "length")]
            if self.prefix_view is not None:  # a release registers what a request computed: its prompt at least
                for sid in ended:
                    if sid not in self._registered:  # else its prompt is in the view already
                        self.prefix_view.remember(self.running[sid].request.prompt_token_ids)
            for sid in done:
                del self.running[sid]
            if ended:
                self._release(ended, finished=True)
            if len(ended) < len(done):
                self._release([sid for sid in done if sid not in ended])
        return events

    def run(self, requests: Iterable[GenerationRequest],
            on_tokens: Callable[[Request, list[int]], None] | None = None) -> list[Request]:
        """Run requests to completion on this thread (the CLI, the bench, tests)."""
        reqs = [self.submit(r) for r in requests]
        while self.has_work:
            for req, kept in self.step():
                if on_tokens is not None and kept:
                    on_tokens(req, kept)
        failed = [r.error for r in reqs if r.error is not None]
        if failed:
            raise failed[0]
        return reqs

    def _sweep(self) -> None:
        """Drop requests that were aborted from another thread; free those that were running."""
        with self._lock:
            if any(r.closed for r in self.waiting):
                self.waiting = deque(r for r in self.waiting if not r.closed)
        gone = [sid for sid, req in self.running.items() if req.closed]
        for sid in gone:
            req = self.running.pop(sid)
            log.info("request %s aborted after %d tokens; released", _label(req, sid), len(req.output))
        if gone:
            self._release(gone)

    # ---- chunked prefill -----------------------------------------------------------------
    def _plan_prefill(self) -> dict[str, int] | None:
        """This step's prompt pieces, seq_id -> tokens, within max_num_batched_tokens: what the
        decodes leave (at least a quarter of the budget), oldest prompt first. A prompt not in
        the plan sits this step out. None: no budget (each prompt whole in its first step)."""
        if self.max_num_batched_tokens is None:
            return None
        left = {sid: t.prefill_left for sid in self.running
                if (t := self.decoder.tracks.get(sid)) is not None and t.prefill_left > 0}
        if not left:
            return None
        budget = self.max_num_batched_tokens
        decoding = sum(self._lookahead(r) + 1 for sid, r in self.running.items() if sid not in left)
        room = max(budget - decoding, budget // 4, 1)
        plan: dict[str, int] = {}
        for sid, n in left.items():
            if room <= 0:
                break
            plan[sid] = min(n, room)
            room -= plan[sid]
        if log.isEnabledFor(logging.DEBUG):
            log.debug("step %d: prefill %s of %s prompt tokens left (budget %d, %d decoding sequences take %d)",
                      self.steps + 1, plan, left, budget, len(self.running) - len(left), decoding)
        return plan

    # ---- KV accounting -------------------------------------------------------------------
    def _may_draft(self, request: GenerationRequest) -> bool:
        """Whether a request may draft at all: there is a drafter, the client did not disable
        speculation, and its K (the server's where it asked for none) is above 0."""
        return (self.decoder.drafter is not None and not request.disable_speculation
                and self.decoder.request_k(request.num_speculative_tokens) > 0)

    def _drafts(self, req: Request) -> bool:
        """Whether the request may ever draft: _may_draft, and not set target-only at submit (the
        drafter's whole cache cannot hold it). One that never drafts takes no room in the
        drafter's cache and no draft slots in the verifier's."""
        return req.target_only is None and self._may_draft(req.request)

    def _lookahead(self, req: Request) -> int:
        """Draft tokens this request may verify next step: its K, capped as the decoder caps it."""
        if not self._drafts(req):
            return 0
        k = self.decoder.request_k(req.request.num_speculative_tokens)
        track = self.decoder.tracks.get(req.seq_id)
        if track is not None:
            k = max(k, track.k)
        return step_k_cap(k, req.num_tokens, self.decoder.max_model_len, req.budget)

    def _on_drafter(self, req: Request) -> bool:
        """Whether the request holds KV on the drafter (or will once the drafter has it): not one
        that never speculates (_drafts: no K, disabled, set target-only at submit; or its track was
        set target-only for good: k = 0)."""
        if not self._drafts(req):
            return False
        track = self.decoder.tracks.get(req.seq_id)
        return track is None or track.k > 0

    def _blocks(self, budget: KvBudget, req: Request) -> int:
        """Blocks the request holds at the end of the next step's forward on this engine (none on
        the drafter for a request that never speculates). A pre-drafting drafter
        (SpecDecoder.async_draft) holds the branch past the k drafts too: the bonus guess and k
        more."""
        if budget.name == "drafter" and not self._on_drafter(req):
            return 0
        k = self._lookahead(req)
        if k and budget.name == "drafter" and self.decoder.async_draft:
            k = min(drafter_reach(k, pre_draft=True), self.decoder.max_model_len - req.num_tokens)
        return budget.blocks(req.num_tokens + k)

    def _fits(self, reqs: Iterable[Request], headroom: int = 0) -> KvBudget | None:
        """The first cache the requests do not fit in (None: they fit in all)."""
        reqs = list(reqs)
        for b in self.kv:
            if sum(self._blocks(b, r) for r in reqs) + headroom > b.num_blocks:
                return b
        return None

    def _make_room(self) -> None:
        """Preempt the newest running requests until the rest fit for the next step."""
        while len(self.running) > 1:
            short = self._fits(self.running.values())
            if short is None:
                return
            newest = max(self.running.values(), key=lambda r: r.arrival)
            self._preempt(newest, short)

    def _preempt(self, req: Request, short: KvBudget) -> None:
        need = sum(self._blocks(short, r) for r in self.running.values())
        del self.running[req.seq_id]
        self._release([req.seq_id])
        self.preemptions += 1
        req.preemptions += 1
        old = req.seq_id
        with self._lock:
            self._live.pop(old, None)
            req.seq_id = f"{old.split('.')[0]}.{req.preemptions}"
            if not req.closed:
                self._live[req.seq_id] = req
                self.waiting.appendleft(req)
        log.info("preempted request %s after %d tokens: the %s's KV cache needs %d of %d blocks for the "
                 "next step; requeued, its %d tokens are recomputed on resume", _label(req, old), len(req.output),
                 short.name, need, short.num_blocks, req.num_tokens)
        self.observer.on_preempt(req)

    def _admit(self) -> None:
        while len(self.running) < self.max_num_seqs:
            with self._lock:
                if not self.waiting:
                    return
                waiting = list(self.waiting)
            if self._prefix_waits:  # forget the ones that left the queue (admitted, aborted)
                self._prefix_waits &= {r.seq_id for r in waiting}
            # the oldest request that need not wait for another's prompt (_prefix_wait)
            leaders = self._computing_prompts()
            req = next((r for r in waiting if r.closed or self._prefix_wait(r, leaders) is None), None)
            if req is None:
                return
            running = list(self.running.values())
            if running and self._fits(running + [req], headroom=len(running) + 1) is not None:
                return  # waits until blocks come back
            with self._lock:
                if req not in self.waiting:
                    continue
                self.waiting.remove(req)
            self._prefix_waits.discard(req.seq_id)
            if req.closed:
                continue
            r = req.request
            try:
                self.decoder.add(req.seq_add(), r.num_speculative_tokens or None, not self._drafts(req))
            except Exception as e:
                err = self.classify(e)
                if err.kind == RequestError.EXHAUSTED and running:
                    # The engines are fuller than this scheduler knows (another gateway shares them):
                    # wait for blocks to come back instead of failing the request.
                    with self._lock:
                        self.waiting.appendleft(req)
                    return
                self._finish(req, error=err)
                if err.broken:
                    self._fail_all(err)
                    return
                continue
            self.running[req.seq_id] = req
            self.observer.on_admit(req, resumed=req.preemptions > 0)
            if self.max_num_batched_tokens is not None and req.num_tokens > self.max_num_batched_tokens:
                log.info("request %s: its %d prompt tokens are prefilled in pieces over %d or more steps "
                         "(max_num_batched_tokens %d), beside %d running", _label(req, req.seq_id), req.num_tokens,
                         -(-req.num_tokens // self.max_num_batched_tokens), self.max_num_batched_tokens,
                         len(self.running) - 1)

    def _computing_prompts(self) -> dict[tuple[int, ...], list[Request]]:
        """Running requests whose prompt's blocks are not registered yet, by their prompt's first
        full block (what _prefix_wait compares a waiting request with; empty without prefix caching)."""
        out: dict[tuple[int, ...], list[Request]] = {}
        if self.prefix_view is None:
            return out
        bs = self.prefix_view.block_size
        for other in self.running.values():
            prompt = other.request.prompt_token_ids
            if other.seq_id not in self._registered and len(prompt) >= bs:
                out.setdefault(tuple(prompt[:bs]), []).append(other)
        return out

    def _prefix_wait(self, req: Request, leaders: dict[tuple[int, ...], list[Request]]) -> Request | None:
        """The running request this one waits for before it is admitted, or None.

        With the verifier's prefix caching, a prompt's full KV blocks that another sequence has
        computed are taken from the cache instead of computed again, but only once they are
        registered: at the start of the step after the one that computed them, or at the
        release of the sequence. Requests that start with the same blocks and arrive together
        (the n choices of one prompt, a batch of completions, a shared system prompt) would all
        compute them in the same step. So a request waits while a running one that is still
        computing its prompt shares more of its blocks than the cache holds already
        (`prefix_view`); then it takes them from the cache. A request that scores its prompt
        computes the whole of it anyway and never waits."""
        if self.prefix_view is None or req.wants_prompt_logprobs:
            return None
        bs = self.prefix_view.block_size
        tokens = tuple(req.request.prompt_token_ids) + tuple(req.output)
        reusable = (len(tokens) - 1) // bs  # the last prompt token is always computed
        want, wait_for = 0, None
        # `leaders` (_computing_prompts): the running ones still computing their prompt, by first block
        for other in leaders.get(tokens[:bs], ()) if reusable > 0 else ():
            shared = shared_blocks(tokens, other.request.prompt_token_ids, bs, reusable)
            if shared > want:
                want, wait_for = shared, other
        if want == 0 or self.prefix_view.cached_blocks(tokens, want) >= want:
            return None
        if req.seq_id not in self._prefix_waits:
            self._prefix_waits.add(req.seq_id)
            log.info("request %s waits for %s to compute the %d prompt blocks they share, then takes them from the "
                     "prefix cache", _label(req, req.seq_id), _label(wait_for, wait_for.seq_id), want)
        return wait_for

    # ---- failures ------------------------------------------------------------------------
    def _step_failed(self, e: BaseException) -> None:
        err = self.classify(e)
        if err.kind == RequestError.EXHAUSTED and not err.broken and len(self.running) > 1:
            # An engine ran out of blocks this scheduler did not account for: make room and retry.
            newest = max(self.running.values(), key=lambda r: r.arrival)
            log.warning("step over %d sequences ran out of KV blocks (%s); preempting %s", len(self.running), err,
                        _label(newest, newest.seq_id))
            self._preempt(newest, self.kv[0] if self.kv else KvBudget("engine", 0, 1))
            return
        name = None if err.broken else culprit(err.message)
        if err.kind == RequestError.INVALID:
            # Every request was validated at submit: an engine refusing the step's own message is
            # this server's fault, not the request's (a 400 would tell the client to change it)
            err = RequestError(RequestError.INTERNAL, f"the server could not run this step: {err.message}", err.cause,
                               err.broken)
        req = self.running.get(name) if name else None
        if req is not None:
            # The failure names one sequence: that request ends alone; the others step again (as
            # after a step that ran out of blocks, nothing of the failed step is kept)
            log.error("step over %d sequences failed on %s: %s; that request ends, the others go on",
                      len(self.running), _label(req, name), err)
            del self.running[name]
            self._finish(req, error=err)
            self._release([name])
            return
        log.error("step over %d sequences failed: %s", len(self.running), err)
        self._fail_all(err)

    def _release(self, seq_ids: list[str], finished: bool = False) -> None:
        try:
            self.decoder.release(seq_ids, finished=finished)
        except Exception as e:
            err = self.classify(e)
            log.error("releasing %d sequences failed: %s", len(seq_ids), err)
            if err.broken:
                self._fail_all(err)

    def fail_all(self, error: BaseException) -> None:
        self._fail_all(self.classify(error))

    def _fail_all(self, err: RequestError) -> None:
        """End every running request (and, when the verifier is gone, every queued one)."""
        victims = list(self.running.values())
        if err.broken:
            with self._lock:
                victims += list(self.waiting)
                self.waiting.clear()
        ids = list(self.running)
        self.running.clear()
        for req in victims:
            self._finish(req, error=err)
        if ids:
            try:
                self.decoder.release(ids)
            except Exception as e:  # the service is gone: it freed them with the stream
                log.debug("release after failure: %s", e)
        if victims:
            log.warning("ended %d requests with %s: %s", len(victims), err.kind, err.message)
