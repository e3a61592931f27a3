"""drafter_svc: a draft model (or the n-gram proposer, --model ngram) behind a thin grpc.aio
servicer. Session messages map one to one onto the Drafter protocol (add, propose,
fetch_rows, release); the servicer converts and calls the engine, nothing else.
"""
from __future__ import annotations

import asyncio
import logging

from specsplit.rpc import wire
from specsplit.rpc.engine_server import info_pb, log_startup, serve
from specsplit.rpc.build import BuiltEngine, build_engine
from specsplit.rpc.sessions import PeerSession, SessionHost
from specsplit.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name


class DrafterServicer(drafter_pb2_grpc.DrafterServicer):
    def __init__(self, built: BuiltEngine, threads: int = 0):
        self.built = built
        self.host = SessionHost("drafter", built.engine, threads, max_seqs_per_session=built.cfg.max_num_seqs)

    def _handle(self, session: PeerSession, req: drafter_pb2.DrafterRequest) -> drafter_pb2.DrafterResponse:
        engine, kind = self.built.engine, req.WhichOneof("kind")
        if kind == "add":
            self.host.add(session, wire.seq_adds_from_pb(req.add, session.to_engine))
            return drafter_pb2.DrafterResponse(id=req.id, ack=common_pb2.Ack())
        if kind == "propose":
            proposals = engine.propose(wire.propose_from_pb(req.propose, session.to_engine))
            return drafter_pb2.DrafterResponse(id=req.id, proposals=wire.proposals_to_pb(proposals, session.from_engine))
        if kind == "fetch_rows":
            rows = engine.fetch_rows(wire.fetch_rows_from_pb(req.fetch_rows, session.to_engine))
            return drafter_pb2.DrafterResponse(id=req.id, rows=drafter_pb2.QRows(rows=wire.rows_to_pb(rows, session.from_engine)))
        if kind == "release":
            self.host.release(session, [session.to_engine(s) for s in req.release.seq_ids], req.release.finished)
            return drafter_pb2.DrafterResponse(id=req.id, ack=common_pb2.Ack())
        raise wire.EngineError("empty DrafterRequest: set add, propose, fetch_rows or release")

    async def Session(self, request_iterator, context):
        async for resp in self.host.session(request_iterator, context, self._handle, drafter_pb2.DrafterResponse):
            yield resp

    async def GetInfo(self, request, context):
        return info_pb(self.built, "drafter", self.host)


def main(args) -> int:
    from specsplit.factory import set_threads

    set_threads(args.threads)
    built = build_engine(args, "drafter")
    log_startup("drafter", built)
    servicer = DrafterServicer(built, args.threads)
    return asyncio.run(serve("drafter", servicer, drafter_pb2_grpc.add_DrafterServicer_to_server, SERVICE_NAME, args))
