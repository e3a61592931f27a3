"""The gateway's scheduler: continuous batching over a SpecDecoder, in one dedicated thread.

Requests join and leave between steps: up to max_num_seqs run, up to max_queue more wait, and a
request beyond that is refused with RESOURCE_EXHAUSTED. Each step's kept tokens (stop rules from
specsplit.generation.RequestState, stop strings and text from gateway.text) go to the request's
sink, a thread-safe callback the async Generate handler reads from. A cancelled request is
released on both services between steps.

The scheduler talks to the decoder only; whether the decoder holds gRPC clients or in-process
engines it never knows. Errors: a request the verifier refuses ends with that status; a step
that fails ends every running request with the step's status; a broken verifier stream ends
every request, running and queued, with UNAVAILABLE.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

import grpc

from rpc import metrics
from gateway.text import TextStream
from rpc.wire import ServiceError, status_code_for, status_message_for
from specsplit.generation import GenerationRequest, RequestState
from specsplit.spec import SpecDecoder

log = logging.getLogger(__name__)


@dataclass
class Event:
    """What the scheduler tells one request's stream: new tokens, the end, or an error."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    usage: dict | None = None
    error: ServiceError | None = None


@dataclass
class _Live:
    state: RequestState
    text: TextStream
    sink: Callable[[Event], None]
    done: bool = False

    @property
    def seq_id(self) -> str:
        return self.state.request.request_id

    def usage(self) -> dict:
        return {
            "prompt_tokens": len(self.state.request.prompt_token_ids),
            "completion_tokens": len(self.state.output),
            "proposed_draft_tokens": self.state.proposed,
            "accepted_draft_tokens": self.state.accepted,
        }


class Scheduler:
    def __init__(
        self,
        decoder: SpecDecoder,
        decode: Callable[[list[int]], str],
        eos_token_ids: Sequence[int],
        max_num_seqs: int,
        max_queue: int,
        timing_sources: Sequence = (),
        idle_poll_s: float = 0.05,
    ):
        self.decoder = decoder
        self.decode = decode
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_num_seqs = max_num_seqs
        self.max_queue = max_queue
        self.timing_sources = list(timing_sources)
        self.idle_poll_s = idle_poll_s
        self.waiting: deque[_Live] = deque()
        self.running: dict[str, _Live] = {}
        self.steps = 0
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._inflight = 0
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)

    # ---- called from any thread ----------------------------------------------------------
    @property
    def inflight(self) -> int:
        with self._lock:
            return self._inflight

    def start(self) -> None:
        self._thread.start()

    def submit(self, request: GenerationRequest, stop: Sequence[str], sink: Callable[[Event], None]) -> None:
        """Queue a request, or raise RESOURCE_EXHAUSTED when running + queued are full."""
        with self._lock:
            if self._inflight >= self.max_num_seqs + self.max_queue:
                raise ServiceError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"the server is full: {self._inflight} requests running or queued "
                    f"(max_num_seqs {self.max_num_seqs} + max_queue {self.max_queue}); retry later",
                )
            self._inflight += 1
        state = RequestState(request)
        self._cmds.put(("submit", _Live(state, TextStream(self.decode, stop), sink)))

    def abort(self, seq_id: str, reason: str = "cancelled") -> None:
        """Drop a request (client cancel or deadline); frees it on both services."""
        self._cmds.put(("abort", seq_id, reason))

    def abort_all(self, reason: str = "abort") -> None:
        self._cmds.put(("abort_all", reason))

    def stop(self, timeout: float = 5.0) -> None:
        self._cmds.put(("stop",))
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ---- the step thread -----------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stopping:
            try:
                self._commands(block=not (self.running or self.waiting))
                if self._stopping:
                    break
                self._admit()
                if self.running:
                    self._step()
            except Exception:  # a bug: end what is running rather than hang every stream
                log.exception("scheduler step failed")
                self._fail_all(ServiceError(grpc.StatusCode.INTERNAL, "internal error in the gateway's scheduler"))
            self._gauges()
        self._fail_all(ServiceError(grpc.StatusCode.UNAVAILABLE, "the gateway is shutting down"))

    def _commands(self, block: bool) -> None:
        try:
            cmd = self._cmds.get(timeout=self.idle_poll_s) if block else self._cmds.get_nowait()
        except queue.Empty:
            return
        while True:
            self._command(cmd)
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return

    def _command(self, cmd) -> None:
        kind = cmd[0]
        if kind == "submit":
            self.waiting.append(cmd[1])
        elif kind == "abort":
            self._abort(cmd[1], cmd[2])
        elif kind == "abort_all":
            for live in list(self.waiting) + list(self.running.values()):
                self._abort(live.seq_id, cmd[1])
        elif kind == "stop":
            self._stopping = True

    def _abort(self, seq_id: str, reason: str) -> None:
        for live in self.waiting:
            if live.seq_id == seq_id:
                self.waiting.remove(live)
                self._finish(live, "abort", outcome=reason)
                return
        live = self.running.pop(seq_id, None)
        if live is None:
            return
        self._finish(live, "abort", outcome=reason)
        self._release([seq_id])
        log.info("request %s aborted (%s) after %d tokens; released", seq_id, reason, len(live.state.output))

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs:
            live = self.waiting.popleft()
            r = live.state.request
            try:
                self.decoder.add(r.seq_add(), r.num_speculative_tokens or None, r.disable_speculation)
            except Exception as e:
                self._finish(live, error=_as_service_error(e))
                if getattr(e, "broken", False):
                    self._fail_all(e)
                    return
                continue
            self.running[r.request_id] = live
            metrics.PROMPT_TOKENS.inc(len(r.prompt_token_ids))

    def _step(self) -> None:
        budgets = {sid: live.state.budget for sid, live in self.running.items()}
        t0 = time.perf_counter()
        try:
            out = self.decoder.step(budgets)
        except Exception as e:
            log.error("step over %d sequences failed: %s", len(self.running), e)
            self._fail_all(e)
            return
        self.steps += 1
        self._observe(out, time.perf_counter() - t0)
        done = []
        for sid, tokens in out.tokens.items():
            live = self.running[sid]
            proposed, accepted = out.drafts.get(sid, (0, 0))
            live.state.proposed += proposed
            live.state.accepted += accepted
            kept = self._feed(live, tokens)
            metrics.GENERATION_TOKENS.inc(len(kept))
            if live.state.finished:
                done.append(sid)
                self._finish(live, live.state.finish_reason, kept)
            elif kept:
                live.sink(Event(kept, live.text.take()))
        if done:
            for sid in done:
                del self.running[sid]
            self._release(done)

    def _feed(self, live: _Live, tokens: list[int]) -> list[int]:
        kept: list[int] = []
        for t in tokens:
            if not live.state.take([t], self.eos_token_ids):
                break
            kept.append(t)
            live.text.add(t)
            if live.text.stopped:
                live.state.finish_reason = "stop"
            if live.state.finished:
                break
        return kept

    def _release(self, seq_ids: list[str]) -> None:
        try:
            self.decoder.release(seq_ids)
        except Exception as e:
            log.error("releasing %d sequences failed: %s", len(seq_ids), e)
            if getattr(e, "broken", False):
                self._fail_all(e)

    def _finish(self, live: _Live, reason: str | None = None, tokens: list[int] | None = None,
                error: ServiceError | None = None, outcome: str | None = None) -> None:
        if live.done:
            return
        live.done = True
        with self._lock:
            self._inflight -= 1
        if error is not None:
            metrics.REQUESTS.labels(error.code.name.lower()).inc()
            live.sink(Event(error=error))
            return
        metrics.REQUESTS.labels(outcome or reason).inc()
        live.sink(Event(list(tokens or []), live.text.take(final=True), reason, live.usage()))

    def _fail_all(self, error: BaseException) -> None:
        """End every running request (and, when the verifier is gone, every queued one)."""
        err = _as_service_error(error)
        victims = list(self.running.values())
        if getattr(error, "broken", False) or self._stopping:
            victims += list(self.waiting)
            self.waiting.clear()
        ids = list(self.running)
        self.running.clear()
        for live in victims:
            self._finish(live, error=err)
        if ids:
            try:
                self.decoder.release(ids)
            except Exception as e:  # the service is gone: it freed them with the stream
                log.debug("release after failure: %s", e)
        if victims:
            log.warning("ended %d requests with %s: %s", len(victims), err.code.name, err.message)

    # ---- metrics -------------------------------------------------------------------------
    def _observe(self, out, total_s: float) -> None:
        st = out.stats
        net = {getattr(s, "role", "peer"): s.take_network_seconds() for s in self.timing_sources}
        metrics.STEP_SECONDS.labels("total").observe(total_s)
        metrics.STEP_SECONDS.labels("verify").observe(max(0.0, st.verify_s - net.get("verifier", 0.0)))
        if out.speculated:
            metrics.STEP_SECONDS.labels("draft").observe(max(0.0, st.draft_s - net.get("drafter", 0.0)))
        if net:
            metrics.STEP_SECONDS.labels("network").observe(sum(net.values()))
        if st.proposed:
            metrics.DRAFT_PROPOSED.inc(st.proposed)
            metrics.DRAFT_ACCEPTED.inc(st.accepted)
            per_position = [0] * len(st.accepted_per_position)
            for proposed, _ in out.drafts.values():
                for j in range(min(proposed, len(per_position))):
                    per_position[j] += 1
            for j, (p, a) in enumerate(zip(per_position, st.accepted_per_position)):
                metrics.POSITION_PROPOSED.labels(str(j)).inc(p)
                metrics.POSITION_ACCEPTED.labels(str(j)).inc(a)

    def _gauges(self) -> None:
        metrics.SEQUENCES.labels("gateway", "running").set(len(self.running))
        metrics.SEQUENCES.labels("gateway", "waiting").set(len(self.waiting))
        metrics.DRAFTER_UP.set(1 if self.decoder.drafter_up else 0)


def _as_service_error(e: BaseException) -> ServiceError:
    if isinstance(e, ServiceError):
        return e
    return ServiceError(status_code_for(e), status_message_for(e))
