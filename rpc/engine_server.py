"""What the drafter and verifier services share: their GetInfo answer, the start-up log line,
and serving one engine until SIGTERM (drain: refuse new sessions and sequences, wait until the
running ones are released, stop) or until the engine fails for good (exit code 1)."""
from __future__ import annotations

import asyncio
import logging

from specsplit.rpc import metrics
from specsplit.rpc.build import BuiltEngine
from specsplit.rpc.security import ServerSecurity
from specsplit.rpc.serving import Server, wait_until
from specsplit.rpc.sessions import SessionHost, kv_stats
from specsplit.sampling.params import SAMPLING_FEATURES
from specsplit.v1 import common_pb2

log = logging.getLogger(__name__)


def info_pb(built: BuiltEngine, role: str, host: SessionHost) -> common_pb2.ServiceInfo:
    cfg = built.cfg
    return common_pb2.ServiceInfo(
        role=role, model=cfg.model, device=str(cfg.device), dtype=str(cfg.dtype).replace("torch.", ""),
        vocab_size=built.vocab_size, max_model_len=cfg.max_model_len, max_num_seqs=cfg.max_num_seqs,
        eos_token_ids=built.eos_token_ids, tokenizer_dir=built.tokenizer_dir,
        kv=kv_stats(built.engine, common_pb2.KvStats), num_running=host.num_running,
        num_sessions=len(host.sessions), memory_plan_json=built.plan_json, serving=not host.draining,
        num_speculative_tokens=built.lookahead - 1,
        step_costs=step_costs_pb(built.engine),
        feature_layers=tuple(getattr(built.engine, "feature_layers", ()) or ()),
        sampling_features=SAMPLING_FEATURES,
    )


def step_costs_pb(engine) -> list:
    """The engine's start-up calibration (specsplit/calibration.py) as StepCost messages:
    the verifier's (batch, rows) steps, or the drafter's cost of one drafted token per batch."""
    costs = getattr(getattr(engine, "model", engine), "step_costs", None)  # HybridDrafter: its model's
    if costs is None:
        return []
    kind = "draft" if costs.draft else "verify"
    return [common_pb2.StepCost(batch=b, rows=r, seconds=t) for b, r, t in costs.as_rows(kind)]


def log_startup(role: str, built: BuiltEngine) -> None:
    bm = getattr(built.engine, "block_manager", None)
    cfg = built.cfg
    if bm is None:
        log.info("%s: %s (no model, no KV cache), max_model_len %d", role, cfg.model, cfg.max_model_len)
        return
    log.info("%s: model %s on %s (%s), vocab %d, max_model_len %d, max_num_seqs %d; KV cache %d blocks x %d tokens, "
             "steps up to %d tokens per sequence", role, cfg.model, cfg.device, str(cfg.dtype).replace("torch.", ""),
             built.vocab_size, cfg.max_model_len, cfg.max_num_seqs, bm.num_blocks, bm.block_size, built.lookahead)


async def serve(role: str, servicer, add_to_server, service_name: str, args) -> int:
    server = Server(role, args.host, args.port, [service_name], ServerSecurity.from_args(args))
    add_to_server(servicer, server.server)
    metrics.watch_kv(role, servicer.built.engine)
    await server.start(metrics_port=args.metrics_port, port_file=getattr(args, "port_file", None))
    host = servicer.host
    # e.g. the verifier's tensor-parallel workers: returns a reason once the engine can never serve
    # again; the process then exits non-zero (a dead TP group is permanent: only a restart helps)
    watch = getattr(servicer, "watch", None)
    watcher = asyncio.ensure_future(watch()) if watch is not None else None

    async def drain():
        host.draining = True
        if not await wait_until(lambda: host.num_running == 0, args.drain_timeout):
            log.warning("%s: %d sequences still running after %.0fs; stopping anyway", role, host.num_running,
                        args.drain_timeout)

    rc = await server.run_until_signal(drain, fatal=watcher)
    host.shutdown()
    return rc
