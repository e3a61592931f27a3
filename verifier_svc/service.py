"""verifier_svc: the target model behind a thin grpc.aio servicer.

Session messages map one to one onto the Verifier protocol (add, verify, resolve, abandon,
release);
the servicer converts protos to dataclasses, calls TargetEngine, converts back. Nothing else.
"""
from __future__ import annotations

import asyncio
import logging

import grpc

from specsplit.rpc import wire
from specsplit.rpc.engine_server import info_pb, log_startup, serve
from specsplit.rpc.build import BuiltEngine, build_engine
from specsplit.rpc.sessions import PeerSession, SessionHost
from specsplit.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name


class VerifierServicer(verifier_pb2_grpc.VerifierServicer):
    def __init__(self, built: BuiltEngine, threads: int = 0):
        self.built = built
        self.host = SessionHost("verifier", built.engine, threads, max_seqs_per_session=built.cfg.max_num_seqs)
        self.tp = built.engine.tensor_parallel  # specsplit.parallel.group.TPGroup, or None

    def _tp_unavailable(self) -> wire.ServiceError:
        return wire.ServiceError(grpc.StatusCode.UNAVAILABLE, f"the verifier cannot serve: {self.tp.failed}")

    def _handle(self, session: PeerSession, req: verifier_pb2.VerifierRequest) -> verifier_pb2.VerifierResponse:
        if self.tp is None:
            return self._handle_one(session, req)
        if self.tp.failed:
            raise self._tp_unavailable()
        try:
            return self._handle_one(session, req)
        except Exception as e:
            from specsplit.parallel.group import is_group_failure

            if is_group_failure(self.tp, e):  # a worker died mid-forward: the group is broken for good
                raise self._tp_unavailable() from e
            raise

    async def watch(self) -> str | None:
        """Tensor parallel: returns why, as soon as a worker dies (the group is broken for good; the
        server then turns NOT_SERVING and the process exits non-zero, see rpc.serving). Open streams
        end UNAVAILABLE on their next step (see _handle). Without TP: None at once (nothing to watch)."""
        if self.tp is None:
            return None
        while not self.tp.failed:
            await asyncio.sleep(0.1)
        return f"the tensor-parallel group failed: {self.tp.failed}"

    def _handle_one(self, session: PeerSession, req: verifier_pb2.VerifierRequest) -> verifier_pb2.VerifierResponse:
        engine, kind = self.built.engine, req.WhichOneof("kind")
        if kind == "add":
            self.host.add(session, wire.seq_adds_from_pb(req.add, session.to_engine))
            return verifier_pb2.VerifierResponse(id=req.id, ack=common_pb2.Ack())
        if kind == "verify":
            results = engine.verify(wire.verify_from_pb(req.verify, session.to_engine))
            return verifier_pb2.VerifierResponse(id=req.id, results=wire.results_to_pb(results, session.from_engine))
        if kind == "resolve":
            results = engine.resolve(wire.rows_from_pb(req.resolve.rows, session.to_engine, expected_size=engine.vocab_size))
            return verifier_pb2.VerifierResponse(id=req.id, results=wire.results_to_pb(results, session.from_engine))
        if kind == "abandon":
            engine.abandon([session.to_engine(s) for s in req.abandon.seq_ids])
            return verifier_pb2.VerifierResponse(id=req.id, ack=common_pb2.Ack())
        if kind == "release":
            self.host.release(session, [session.to_engine(s) for s in req.release.seq_ids])
            return verifier_pb2.VerifierResponse(id=req.id, ack=common_pb2.Ack())
        raise wire.EngineError("empty VerifierRequest: set add, verify, resolve, abandon or release")

    async def Session(self, request_iterator, context):
        if self.tp is not None and self.tp.failed:
            await context.abort(grpc.StatusCode.UNAVAILABLE, self._tp_unavailable().message)
        async for resp in self.host.session(request_iterator, context, self._handle, verifier_pb2.VerifierResponse):
            yield resp

    async def GetInfo(self, request, context):
        info = info_pb(self.built, "verifier", self.host)
        if self.tp is not None and self.tp.failed:
            info.serving = False
        return info


def main(args) -> int:
    from specsplit.factory import set_threads

    set_threads(args.threads)
    built = build_engine(args, "verifier")
    log_startup("verifier", built)
    servicer = VerifierServicer(built, args.threads)
    try:
        return asyncio.run(serve("verifier", servicer, verifier_pb2_grpc.add_VerifierServicer_to_server, SERVICE_NAME, args))
    finally:
        if servicer.tp is not None:
            servicer.tp.close()  # no worker outlives the service
