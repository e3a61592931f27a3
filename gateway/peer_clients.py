"""gRPC clients implementing the Drafter and Verifier protocols (specsplit.protocols).

    SpecDecoder(verifier=GrpcVerifier(addr), drafter=GrpcDrafter(addr))   # split
    SpecDecoder(TargetEngine(...), DraftEngine(...))                     # colocated

Each client holds one Session stream (opened on first use, reopened after it breaks) and is
called from one thread, the gateway's step loop. A call sends one request and waits for its
response with a per-call deadline; the stream is read by a background thread so a deadline
never depends on the peer.

Failures raise RemoteError: `broken=True` when the stream is gone (the service then frees every
sequence added on it, so the sequences this client knew are lost), `broken=False` when the
service refused one request (the stream and its sequences go on). SpecDecoder turns drafter
failures into target-only steps and re-syncs; the gateway ends every stream when the verifier
breaks. The channel reconnects on its own, with a short backoff, when the service comes back.
"""
from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Sequence

import grpc

from specsplit.rpc import wire
from specsplit.rpc import security as sec
from specsplit.rpc.serving import MAX_MESSAGE_BYTES
from specsplit.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from specsplit.protocols import (DrafterTraits, Proposal, ProposeRequest, QRow, RowRequest, SeqAdd, VerifierTraits,
                                 VerifyRequest, VerifyResult)

log = logging.getLogger(__name__)

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Reconnect quickly when a restarted service comes back (the default backoff grows to 120 s).
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.enable_retries", 0),
]


class RemoteError(wire.ServiceError):
    def __init__(self, code: grpc.StatusCode, message: str, broken: bool):
        super().__init__(code, message)
        self.broken = broken
        self.kind = code.name.lower()  # as a RequestError names it (specsplit.spec.drafter_health.refused)
        self.timed_out = False  # no answer within the call's deadline


class _Ended:
    def __init__(self, error: grpc.RpcError | None):
        self.error = error


_CLOSE = object()


class _SessionStream:
    """One Session stream: call(request, timeout) -> response, or raise _StreamBroken."""

    def __init__(self, method, name: str):
        self._out: queue.SimpleQueue = queue.SimpleQueue()
        self._in: queue.SimpleQueue = queue.SimpleQueue()
        self._call = method(iter(self._out.get, _CLOSE))
        self.closed = False
        self.ended = False  # the service ended the stream (seen by the reader, maybe before any call)
        threading.Thread(target=self._read, name=f"{name}-stream-reader", daemon=True).start()

    def _read(self) -> None:
        end = _Ended(None)
        try:
            for resp in self._call:
                self._in.put(resp)
        except grpc.RpcError as e:
            end = _Ended(e)
        except Exception as e:  # never leave a caller waiting
            log.debug("stream reader stopped: %s", e)
        self.ended = True
        self._in.put(end)

    def call(self, request, timeout: float | None):
        self._out.put(request)
        try:
            item = self._in.get(timeout=timeout)
        except queue.Empty:
            self.close()
            raise _StreamBroken(f"no answer within {timeout:g}s; the stream was cancelled", timed_out=True) from None
        if isinstance(item, _Ended):
            self.close()
            if item.error is None:
                raise _StreamBroken("the service closed the stream")
            raise _StreamBroken(f"{item.error.code().name}: {item.error.details()}", item.error.code())
        if item.id != request.id:
            self.close()
            raise _StreamBroken(f"answer {item.id} to request {request.id}: protocol error")
        return item

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._out.put(_CLOSE)
            self._call.cancel()


class _StreamBroken(Exception):
    def __init__(self, message: str, code: grpc.StatusCode | None = None, timed_out: bool = False):
        super().__init__(message)
        self.code = code
        self.timed_out = timed_out


class _PeerClient:
    role = "peer"
    request_cls = None
    stub_cls = None

    def __init__(self, address: str, timeout: float, security: sec.ClientSecurity | None = None, keepalive=None):
        self.address = address
        self.timeout = timeout
        options = CHANNEL_OPTIONS + list(keepalive if keepalive is not None else sec.keepalive_options())
        self.channel = sec.channel(address, security, options)
        self.stub = self.stub_cls(self.channel)
        self._stream: _SessionStream | None = None
        self._ids = itertools.count(1)
        self._live: set[str] = set()  # sequences added on the current stream
        self._network_s = 0.0
        self._timeouts = 0  # consecutive deadlines: back off before trying again
        self._retry_at = 0.0

    # ---- plumbing ------------------------------------------------------------------------
    def take_network_seconds(self) -> float:
        """Round-trip time not spent in the engine since the last call (for step metrics)."""
        s, self._network_s = self._network_s, 0.0
        return s

    def _unavailable(self, why: str) -> RemoteError:
        return RemoteError(grpc.StatusCode.UNAVAILABLE, f"the {self.role} at {self.address} is unavailable: {why}", True)

    def _request(self, timeout: float | None = None, **kind):
        now = time.monotonic()
        if now < self._retry_at:
            raise self._unavailable(f"it missed {self._timeouts} deadline(s); next try in {self._retry_at - now:.1f}s")
        if self._stream is not None and (self._stream.closed or self._stream.ended):
            # Gone while idle (the service restarted, say). Its sequences went with it.
            self._stream.close()
            self._stream = None
            if self._live:
                lost = len(self._live)
                self._live.clear()
                raise self._unavailable(f"the connection was lost; its {lost} sequences are gone")
        if self._stream is None:
            self._stream = _SessionStream(self.stub.Session, self.role)
        req = self.request_cls(id=next(self._ids), **kind)
        t0 = time.perf_counter()
        try:
            resp = self._stream.call(req, timeout or self.timeout)
        except _StreamBroken as e:
            self._stream = None
            lost = len(self._live)
            self._live.clear()
            if e.timed_out:
                self._timeouts += 1
                self._retry_at = time.monotonic() + min(30.0, 2.0 ** (self._timeouts - 1))
            if lost:
                log.warning("%s stream at %s broke (%s); its %d sequences are gone", self.role, self.address, e, lost)
            err = self._unavailable(str(e))
            err.timed_out = e.timed_out  # a missed deadline: the peer is late, not gone (drafter_health probes at once)
            raise err from None
        self._timeouts = 0
        self._network_s += max(0.0, time.perf_counter() - t0 - resp.compute_s)
        if resp.HasField("error"):
            raise RemoteError(wire.code_from_int(resp.error.code), resp.error.message, False)
        return resp

    def _check_live(self, seq_ids) -> None:
        lost = [s for s in seq_ids if s not in self._live]
        if lost:
            raise self._unavailable(f"the connection was lost; sequences {lost[:3]} are gone with it")

    def add(self, seqs: Sequence[SeqAdd]) -> None:
        self._request(add=wire.seq_adds_to_pb(seqs))
        self._live.update(s.seq_id for s in seqs)

    def release(self, seq_ids: Sequence[str], finished: bool = False) -> None:
        self._release(seq_ids, finished)

    def _release(self, seq_ids: Sequence[str], finished: bool, timeout: float | None = None) -> None:
        """Never fails for a lost connection: the service freed those sequences itself."""
        ids = [s for s in seq_ids if s in self._live]
        if not ids or self._stream is None:
            return
        try:
            self._request(timeout, release=common_pb2.Release(seq_ids=ids, finished=finished))
        except RemoteError as e:
            if not e.broken:
                raise
        finally:
            self._live.difference_update(ids)

    def info(self, timeout: float = 5.0, wait_for_ready: bool = False) -> common_pb2.ServiceInfo:
        return self.stub.GetInfo(common_pb2.InfoRequest(), timeout=timeout, wait_for_ready=wait_for_ready)

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
        self.channel.close()


class GrpcDrafter(_PeerClient, DrafterTraits):
    """The Drafter protocol over a drafter_svc Session stream (short deadlines: a slow drafter
    must not hold up the step; SpecDecoder falls back to target-only)."""

    role = "drafter"
    request_cls = drafter_pb2.DrafterRequest
    stub_cls = drafter_pb2_grpc.DrafterStub

    def __init__(self, address: str, timeout: float = 5.0, **kw):
        super().__init__(address, timeout, **kw)
        # The target layers a feature drafter reads: from its GetInfo (info() records them: at
        # start-up, and in each probe before a re-sync, so a drafter that was unreachable at start-up
        # gets its features for the requests that come after it answers).
        self.feature_layers: tuple[int, ...] = ()
        self.max_model_len: int | None = None  # its --max-model-len, also from GetInfo
        self.deadline_s: float | None = None
        self._probes: ThreadPoolExecutor | None = None  # the thread probe() asks GetInfo on

    def info(self, timeout: float = 5.0, wait_for_ready: bool = False) -> common_pb2.ServiceInfo:
        info = super().info(timeout, wait_for_ready)
        self.feature_layers = tuple(info.feature_layers)
        self.max_model_len = info.max_model_len or None
        return info

    def reachable(self, timeout: float) -> bool:
        try:
            # wait_for_ready: a channel between reconnect attempts would fail at once, not connect
            self.info(timeout=timeout, wait_for_ready=True)
        except grpc.RpcError:
            return False
        # It answers: the back-off after missed deadlines (in _request) has done its job
        self._timeouts, self._retry_at = 0, 0.0
        return True

    def probe(self, timeout: float) -> Future:
        """GetInfo on the probe thread (GetInfo is a unary call beside the Session stream, so it
        never races the step thread's calls on that stream)."""
        if self._probes is None:
            self._probes = ThreadPoolExecutor(max_workers=1, thread_name_prefix="drafter-probe")
        return self._probes.submit(self.reachable, timeout)

    def close(self) -> None:
        if self._probes is not None:
            self._probes.shutdown(wait=False, cancel_futures=True)
        super().close()

    def _deadline(self) -> float:
        return self.timeout if self.deadline_s is None else min(self.timeout, self.deadline_s)

    def add(self, seqs: Sequence[SeqAdd]) -> None:
        """Under the step's deadline too (an add is the tokens' ids, no compute: the drafter
        computes them in the proposes after it): a hung drafter costs one bounded wait here too."""
        self._request(self._deadline(), add=wire.seq_adds_to_pb(seqs))
        self._live.update(s.seq_id for s in seqs)

    def release(self, seq_ids: Sequence[str], finished: bool = False) -> None:
        self._release(seq_ids, finished, self._deadline())

    def propose(self, reqs: Sequence[ProposeRequest]) -> list[Proposal]:
        self._check_live(r.seq_id for r in reqs)
        resp = self._request(self._deadline(), propose=wire.propose_to_pb(reqs))
        return wire.proposals_from_pb(resp.proposals)

    def fetch_rows(self, fetch: Sequence[RowRequest]) -> list[QRow]:
        self._check_live(r.seq_id for r in fetch)
        resp = self._request(self._deadline(), fetch_rows=wire.fetch_rows_to_pb(fetch))
        return wire.rows_from_pb(resp.rows.rows)


class GrpcVerifier(_PeerClient, VerifierTraits):
    """The Verifier protocol over a verifier_svc Session stream."""

    role = "verifier"
    request_cls = verifier_pb2.VerifierRequest
    stub_cls = verifier_pb2_grpc.VerifierStub

    def __init__(self, address: str, timeout: float = 120.0, vocab_size: int | None = None, **kw):
        super().__init__(address, timeout, **kw)
        self.vocab_size = vocab_size  # recorded by info() from the verifier's GetInfo

    def info(self, timeout: float = 5.0, wait_for_ready: bool = False) -> common_pb2.ServiceInfo:
        info = super().info(timeout, wait_for_ready)
        self.vocab_size = info.vocab_size or None
        return info

    def verify(self, reqs: Sequence[VerifyRequest]) -> list[VerifyResult]:
        if not reqs:
            return []
        self._check_live(r.seq_id for r in reqs)
        resp = self._request(verify=wire.verify_to_pb(reqs))
        return wire.results_from_pb(resp.results)

    def resolve(self, rows: Sequence[QRow]) -> list[VerifyResult]:
        if not rows:
            return []
        self._check_live(r.seq_id for r in rows)
        resp = self._request(resolve=verifier_pb2.ResolveBatch(rows=wire.rows_to_pb(rows)))
        return wire.results_from_pb(resp.results)

    def abandon(self, seq_ids: Sequence[str]) -> None:
        if not seq_ids:
            return
        self._check_live(seq_ids)
        self._request(abandon=verifier_pb2.AbandonStep(seq_ids=list(seq_ids)))
