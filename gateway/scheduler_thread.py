"""The gateway's adaptor around the one Scheduler (specsplit.scheduler): a step thread, the
Prometheus observer, and the mapping of RequestError kinds to gRPC status codes.

Admission, KV-aware preemption, stop rules, usage and acceptance all live in the Scheduler; here
only threads and status codes. The step thread runs `Scheduler.step` (engine RPCs included);
submit and abort come from the event loop and never wait for it: an abort ends the stream at once,
even while a step's RPC is in flight, and the step thread frees the sequence after that step.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Sequence


from specsplit.rpc import metrics
from specsplit.rpc.wire import ServiceError, code_for_kind
from specsplit.request import Event, GenerationRequest, Limits, Request, RequestError, error_from_exception
from specsplit.scheduler import KvBudget, Observer
from specsplit.scheduler import Scheduler
from specsplit.spec import SpecDecoder

log = logging.getLogger(__name__)

__all__ = ["Event", "SchedulerThread", "classify", "status_of"]


def classify(e: BaseException) -> RequestError:
    """Engine / peer exception -> RequestError; a peer's status code is kept as the kind."""
    if isinstance(e, RequestError):
        return e
    if isinstance(e, ServiceError):
        return RequestError(e.code.name.lower(), e.message, e, bool(getattr(e, "broken", False)))
    return error_from_exception(e)


def status_of(err: RequestError) -> ServiceError:
    """RequestError -> the ServiceError (gRPC status + message) the client gets."""
    return ServiceError(code_for_kind(err.kind), err.message)


class _Metrics(Observer):
    def __init__(self, timing_sources: Sequence = (), async_draft: bool = False):
        self.timing_sources = list(timing_sources)
        self.async_draft = async_draft

    def on_admit(self, request: Request, resumed: bool) -> None:
        if not resumed:
            metrics.PROMPT_TOKENS.inc(len(request.prompt_token_ids))

    def on_tokens(self, request: Request, kept: list[int]) -> None:
        metrics.GENERATION_TOKENS.inc(len(kept))

    def on_preempt(self, request: Request) -> None:
        metrics.PREEMPTIONS.inc()

    def on_finish(self, request: Request, outcome: str) -> None:
        metrics.REQUESTS.labels(outcome).inc()

    def on_step(self, out, total_s: float) -> None:
        st = out.stats
        net = {getattr(s, "role", "peer"): s.take_network_seconds() for s in self.timing_sources}
        metrics.STEP_SECONDS.labels("total").observe(total_s)
        metrics.STEPS.labels(str(out.k)).inc()
        metrics.STEP_SECONDS.labels("verify").observe(max(0.0, st.verify_s - net.get("verifier", 0.0)))
        if out.speculated:
            metrics.STEP_SECONDS.labels("draft").observe(max(0.0, st.draft_s - net.get("drafter", 0.0)))
        if net:
            metrics.STEP_SECONDS.labels("network").observe(sum(net.values()))
        if st.branches:
            metrics.BRANCHES.labels("hit").inc(st.branch_hits)
            metrics.BRANCHES.labels("miss").inc(st.branch_misses)
        if out.speculated and self.async_draft:
            metrics.DRAFT_WAIT.observe(st.draft_wait_s)
        if st.tree_nodes:
            metrics.TREE_NODES.inc(st.tree_nodes)
        if st.catch_up_pieces:
            metrics.CATCH_UP_PIECES.inc(st.catch_up_pieces)
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


class SchedulerThread:
    """The one Scheduler (`.scheduler`), stepped on its own thread; submit and abort are safe from
    the event loop. Adds the Prometheus observer, nothing else."""

    def __init__(
        self,
        decoder: SpecDecoder,
        decode: Callable[[list[int]], str],
        eos_token_ids: Sequence[int],
        max_num_seqs: int,
        max_queue: int,
        kv: Sequence[KvBudget] | None = None,
        limits: Limits | None = None,
        timing_sources: Sequence = (),
        idle_poll_s: float = 0.05,
        max_num_batched_tokens: int | None = None,
    ):
        self.scheduler = Scheduler(decoder, eos_token_ids, max_num_seqs, max_queue, kv=kv, limits=limits,
                                   decode=decode, observer=_Metrics(timing_sources, decoder.async_draft),
                                  classify=classify, max_num_batched_tokens=max_num_batched_tokens)
        self.decoder = decoder
        self.idle_poll_s = idle_poll_s
        self._stopping = False
        self._step_since: float | None = None  # when the step in progress began (None: between steps)
        self._thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)

    # ---- any thread ----------------------------------------------------------------------
    @property
    def inflight(self) -> int:
        return self.scheduler.inflight

    @property
    def running(self):
        return self.scheduler.running

    @property
    def waiting(self):
        return self.scheduler.waiting

    def start(self) -> None:
        self._thread.start()

    def stalled(self, limit_s: float) -> str | None:
        """Why the step thread cannot serve (it died, or one step has run longer than limit_s), or None."""
        if self._thread.ident is not None and not self._thread.is_alive() and not self._stopping:
            return "the gateway's scheduler thread died"
        since = self._step_since
        if since is not None and time.monotonic() - since > limit_s:
            return f"a scheduler step has run for {time.monotonic() - since:.0f}s (--stall-timeout {limit_s:g})"
        return None

    def submit(self, request: GenerationRequest, sink: Callable[[Event], None]) -> Request:
        """Queue a request; ServiceError (INVALID_ARGUMENT, RESOURCE_EXHAUSTED) when it cannot be."""
        try:
            return self.scheduler.submit(request, sink)
        except RequestError as e:
            raise status_of(e) from None

    def abort(self, request: Request, reason: str = "cancelled") -> None:
        """Client cancel or deadline: the stream ends now; the KV is freed after the current step."""
        self.scheduler.abort(request, reason)

    def abort_all(self, error: RequestError | None = None, reason: str = "abort") -> int:
        return self.scheduler.abort_all(reason, error)

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping = True
        self.scheduler.abort_all("abort", RequestError(RequestError.UNAVAILABLE, "the gateway is shutting down"))
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ---- the step thread -----------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stopping:
            try:
                self.scheduler.wait_for_work(self.idle_poll_s)
                if self._stopping:
                    break
                self._step_since = time.monotonic()
                try:
                    self.scheduler.step()
                finally:
                    self._step_since = None
            except Exception:  # a bug: end what is running rather than hang every stream
                log.exception("scheduler step failed")
                self.scheduler.fail_all(RequestError(RequestError.INTERNAL, "internal error in the gateway's scheduler"))
            self._gauges()

    def _gauges(self) -> None:
        metrics.SEQUENCES.labels("gateway", "running").set(len(self.scheduler.running))
        metrics.SEQUENCES.labels("gateway", "waiting").set(len(self.scheduler.waiting))
        metrics.DRAFTER_UP.set(1 if self.decoder.drafter_up else 0)
