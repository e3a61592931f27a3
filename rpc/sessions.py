"""The Session stream behind the drafter and verifier servicers.

One engine per service, driven by one worker thread (engine calls never overlap and never block
the event loop, so health checks and GetInfo answer during a long forward). Each Session stream
is one peer: its sequence ids are namespaced ("<session>:<seq_id>") so two streams never collide,
and everything a stream added is freed when the stream ends, however it ends (client gone,
cancelled, network). Every request gets exactly one response; a failed request carries a Status
and changes nothing, and the stream goes on.

Isolation: a session sees only its own sequences (namespace), holds at most
`max_seqs_per_session` of them (RESOURCE_EXHAUSTED past it), and every engine call names only
the session's own sequences (per-sequence state such as the drafter's q rows lives with each
sequence), so two gateways sharing one engine never touch each other's KV, q rows or random
streams.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Callable

import grpc

from specsplit.rpc import metrics
from specsplit.rpc.wire import ServiceError, status_pb

log = logging.getLogger(__name__)


class PeerSession:
    def __init__(self, number: int):
        self.number = number
        self.prefix = f"{number}:"
        self.owned: set[str] = set()  # engine-side ids; touched only on the worker thread

    def to_engine(self, seq_id: str) -> str:
        return self.prefix + seq_id

    def from_engine(self, seq_id: str) -> str:
        return seq_id[len(self.prefix):] if seq_id.startswith(self.prefix) else seq_id

    def clean(self, message: str) -> str:
        return message.replace("'" + self.prefix, "'")


class SessionHost:
    """Runs an engine's session messages on one worker thread."""

    def __init__(self, role: str, engine, threads: int = 0, max_seqs_per_session: int | None = None):
        self.role = role
        self.engine = engine
        self.max_seqs_per_session = max_seqs_per_session
        self._counter = itertools.count(1)
        self.sessions: dict[int, PeerSession] = {}
        self.draining = False

        def init_worker():
            if threads:
                import torch

                torch.set_num_threads(threads)

        self.executor = ThreadPoolExecutor(1, thread_name_prefix=f"{role}-engine", initializer=init_worker)

    @property
    def num_running(self) -> int:
        return self.engine.num_running

    async def run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def add(self, session: PeerSession, seqs) -> None:
        """Engine add under the session's namespace (worker thread)."""
        if self.draining:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, f"the {self.role} is shutting down; it takes no new sequences")
        limit = self.max_seqs_per_session
        if limit is not None and len(session.owned) + len(seqs) > limit:
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"session {session.number} holds {len(session.owned)} sequences on the {self.role} and "
                               f"adds {len(seqs)}: each session may hold at most {limit} (the {self.role}'s "
                               f"--max-num-seqs); release finished sequences first")
        self.engine.add(seqs)
        session.owned.update(s.seq_id for s in seqs)

    def release(self, session: PeerSession, engine_ids: list[str], finished: bool = False) -> None:
        self.engine.release(engine_ids, finished=finished)
        session.owned.difference_update(engine_ids)

    def _release_all(self, session: PeerSession) -> None:
        if session.owned:
            log.info("%s session %d ended; freeing its %d sequences", self.role, session.number, len(session.owned))
            self.engine.release(list(session.owned))
            session.owned.clear()

    async def session(
        self,
        requests: AsyncIterator,
        context: grpc.aio.ServicerContext,
        handle: Callable,
        make_response: Callable,
    ):
        """Serve one Session stream. handle(session, request) -> response runs on the worker;
        make_response(id=..., error=...) builds an error response."""
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the {self.role} is shutting down; connect to another one")
        session = PeerSession(next(self._counter))
        self.sessions[session.number] = session
        log.info("%s session %d opened by %s", self.role, session.number, context.peer())
        metrics.SEQUENCES.labels(self.role, "sessions").set(len(self.sessions))
        try:
            async for req in requests:
                op = req.WhichOneof("kind") or "none"
                t0 = time.perf_counter()
                try:
                    resp = await self.run(handle, session, req)
                except Exception as e:  # the request failed; the stream goes on
                    if not isinstance(e, ServiceError):
                        log.debug("%s %s failed: %s", self.role, op, e)
                    err = status_pb(e)
                    err.message = session.clean(err.message)
                    resp = make_response(id=req.id, error=err)
                dt = time.perf_counter() - t0
                resp.compute_s = dt
                metrics.ENGINE_SECONDS.labels(self.role, op).observe(dt)
                metrics.SEQUENCES.labels(self.role, "running").set(self.engine.num_running)
                yield resp
        except asyncio.CancelledError:  # the peer went away or the server is stopping: not an error
            pass
        finally:
            # Reads session.owned on the worker, after any call still running there.
            self.executor.submit(self._release_all, session)
            self.sessions.pop(session.number, None)
            metrics.SEQUENCES.labels(self.role, "sessions").set(len(self.sessions))
            log.info("%s session %d closed", self.role, session.number)

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=False)


def kv_stats(engine, pb_cls):
    bm = getattr(engine, "block_manager", None)
    if bm is None:
        return pb_cls(paged=False)
    return pb_cls(paged=True, num_blocks=bm.num_blocks, free_blocks=bm.num_free_blocks, block_size=bm.block_size,
                  prefix_caching=bool(getattr(bm, "prefix_caching", False)))

