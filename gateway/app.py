"""Assemble and run a gateway: split (gRPC clients to a drafter and a verifier) or colocated
(the engines in this process, from specsplit.factory.build_colocated). Both run the same
scheduler and the same public service; only the decoder's verifier and drafter differ.
"""
from __future__ import annotations

import asyncio
import json
import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from specsplit.rpc import metrics
from specsplit.gateway.peer_clients import GrpcDrafter, GrpcVerifier
from specsplit.rpc.build import plan_to_dict, static_plan
from specsplit.rpc.health import error_text
from specsplit.gateway.scheduler_thread import SchedulerThread
from specsplit.gateway.service import SERVICE_NAME, GatewayServicer, Limits, Tokenizer
from specsplit.rpc.security import MAX_REQUEST_BYTES, ClientSecurity, ServerSecurity, keepalive_options
from specsplit.rpc.serving import Server, wait_until
from specsplit.rpc.sessions import kv_stats
from grpc_health.v1 import health_pb2
from specsplit.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from specsplit.request import RequestError
from specsplit.sampling.grammar import DEFAULT_COMPILE_TIMEOUT_S, GrammarCompiler
from specsplit.scheduler import KvBudget
from specsplit.defaults import spec_config
from specsplit.calibration import StepCosts
from specsplit.spec import SpecDecoder

log = logging.getLogger(__name__)

UNKNOWN = "unknown"


@dataclass
class Gateway:
    decoder: SpecDecoder
    tokenizer: Tokenizer
    eos_token_ids: tuple[int, ...]
    limits: Limits
    max_num_seqs: int
    max_queue: int
    mode: str
    target_model: str
    draft_model: str
    services: Callable[[], Awaitable[list[gateway_pb2.ServiceStatus]]]
    timing_sources: list = field(default_factory=list)
    kv: list[KvBudget] | None = None  # None: read from the in-process engines
    grammars: GrammarCompiler | None = None  # structured output's compiler (admission)
    # Why the target cannot serve now (blocking; run off the event loop), or None: the split
    # verifier does not answer or reports NOT_SERVING; a colocated tensor-parallel group failed.
    engine_health: Callable[[], str | None] | None = None
    # Completes with a reason once the target can never serve again (colocated: a dead
    # tensor-parallel worker): the process then exits non-zero (rpc.serving.run_until_signal).
    fatal: Callable[[], Awaitable[str | None]] | None = None


HEALTH_PROBE_S = 1.0
DEFAULT_STALL_TIMEOUT_S = 300.0  # --stall-timeout (specsplit/cli/common.py)


def _unhealthy(gw: Gateway, scheduler: SchedulerThread, stall_timeout: float) -> str | None:
    """Why the gateway cannot serve now, or None (blocking: the verifier is asked)."""
    return scheduler.stalled(stall_timeout) or (gw.engine_health() if gw.engine_health is not None else None)


async def _watch_health(gw: Gateway, server: Server, scheduler: SchedulerThread, stall_timeout: float,
                        on_change: Callable[[str | None], None] = lambda why: None) -> None:
    """gRPC health (and, through on_change, HTTP /health) follow what the gateway can do: NOT_SERVING
    while the verifier does not answer or reports NOT_SERVING, or the step thread is stuck or dead;
    SERVING again when that passes. The drain sets NOT_SERVING for good (and ends this watch)."""
    loop = asyncio.get_running_loop()
    current: str | None = None
    while not server.draining:
        why = await loop.run_in_executor(None, _unhealthy, gw, scheduler, stall_timeout)
        if server.draining:
            return
        if why != current:
            if (why is None) != (current is None):
                status = health_pb2.HealthCheckResponse.SERVING if why is None else health_pb2.HealthCheckResponse.NOT_SERVING
                for name in ("", SERVICE_NAME):
                    await server.health.set(name, status)
                log.warning("gateway: health %s%s", "SERVING" if why is None else "NOT_SERVING: ", why or "")
            current = why
            on_change(why)
        await asyncio.sleep(HEALTH_PROBE_S)


def _costs_fields(decoder) -> dict:
    """The K policy's calibrated step costs for ServerInfo (empty with a fixed K)."""
    policy = getattr(decoder, "policy", None)
    if policy is None:
        return {}
    c = policy.costs
    return {"verify_costs": [common_pb2.StepCost(batch=b, rows=r, seconds=t) for b, r, t in c.as_rows("verify")],
            "draft_costs": [common_pb2.StepCost(batch=b, rows=r, seconds=t) for b, r, t in c.as_rows("draft")],
            "network_s": c.network_s}


def _kv_pb(kv) -> gateway_pb2.KvBlocks:
    return gateway_pb2.KvBlocks(paged=kv.paged, num_blocks=kv.num_blocks, free_blocks=kv.free_blocks, block_size=kv.block_size,
                                prefix_caching=kv.prefix_caching)


async def run(gw: Gateway, args) -> int:
    scheduler = SchedulerThread(gw.decoder, gw.tokenizer.decode, gw.eos_token_ids, gw.max_num_seqs, gw.max_queue,
                                 kv=gw.kv, limits=gw.limits, timing_sources=gw.timing_sources,
                                 max_num_batched_tokens=getattr(args, "max_num_batched_tokens", None) or None)
    spec = gw.decoder.spec

    async def server_info() -> gateway_pb2.ServerInfo:
        services = await gw.services()
        draft_model = gw.draft_model
        if draft_model == UNKNOWN:  # the drafter was not up when the gateway started
            draft_model = next((s.model for s in services if s.name == "drafter" and s.reachable), UNKNOWN)
            gw.draft_model = draft_model
        return gateway_pb2.ServerInfo(
            mode=gw.mode, target_model=gw.target_model, draft_model=draft_model,
            num_speculative_tokens=spec.num_speculative_tokens if gw.decoder.drafter is not None else 0,
            disable_by_batch_size=spec.disable_by_batch_size, max_model_len=gw.limits.max_model_len,
            max_num_seqs=gw.max_num_seqs, max_queue=gw.max_queue, vocab_size=gw.limits.vocab_size,
            eos_token_ids=gw.eos_token_ids, drafter_up=gw.decoder.drafter_up,
            num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
            services=services, **_costs_fields(gw.decoder),
            async_draft=gw.decoder.async_draft, branch_hits=gw.decoder.branch_hits,
            branch_misses=gw.decoder.branch_misses,
        )

    servicer = GatewayServicer(scheduler, gw.tokenizer, gw.limits, server_info, grammars=gw.grammars,
                               capacity=(gw.max_num_seqs, gw.max_queue))
    server = Server("gateway", args.host, args.port, [SERVICE_NAME], ServerSecurity.from_args(args),
                    max_receive_bytes=getattr(args, "max_request_bytes", MAX_REQUEST_BYTES),
                    max_concurrent_rpcs=getattr(args, "max_concurrent_rpcs", None))
    gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, server.server)
    scheduler.start()
    unhealthy: list[str | None] = [None]
    http = None
    if getattr(args, "http_port", None):  # bound before gRPC reports SERVING: ready means both are
        from specsplit.gateway.http_api import build_http_server

        http = build_http_server(servicer, gw.target_model, args,
                                 lambda: "draining" if server.draining else unhealthy[0])
        await http.start()
    await server.start(metrics_port=args.metrics_port, port_file=getattr(args, "port_file", None))
    log.info("gateway (%s): target %s, draft %s, K=%d, disable_by_batch_size=%d, max_num_seqs %d, max_queue %d, "
             "max_model_len %d, pre-drafting %s, max_num_batched_tokens %s", gw.mode, gw.target_model,
             gw.draft_model or "none", spec.num_speculative_tokens if gw.decoder.drafter is not None else 0,
             spec.disable_by_batch_size, gw.max_num_seqs, gw.max_queue, gw.limits.max_model_len,
             "on" if gw.decoder.async_draft else "off", scheduler.scheduler.max_num_batched_tokens or "unbounded")
    log.info("gateway: %s", gw.tokenizer.chat.describe())
    for b in scheduler.scheduler.kv:
        log.info("gateway: KV-aware admission over the %s's cache: %d blocks x %d tokens", b.name, b.num_blocks,
                 b.block_size)

    def on_change(why: str | None) -> None:
        unhealthy[0] = why

    stall_timeout = getattr(args, "stall_timeout", DEFAULT_STALL_TIMEOUT_S)
    watcher = asyncio.ensure_future(_watch_health(gw, server, scheduler, stall_timeout, on_change))

    async def drain():
        servicer.draining = True  # requests still being tokenized end UNAVAILABLE (GatewayServicer.submit)
        if not await wait_until(lambda: not servicer.busy, args.drain_timeout):
            n = scheduler.abort_all(RequestError(
                RequestError.UNAVAILABLE,
                f"the server shut down before this request finished (drain timeout {args.drain_timeout:.0f}s); retry it"))
            log.warning("gateway: %d requests still live after %.0fs; ended them with UNAVAILABLE", n, args.drain_timeout)
            await wait_until(lambda: scheduler.inflight == 0, 2.0)

    rc = await server.run_until_signal(drain, fatal=gw.fatal() if gw.fatal is not None else None)
    watcher.cancel()
    if http is not None:
        await http.stop()
    scheduler.stop()
    return rc


# ---- split mode ------------------------------------------------------------------------------
def _status_from_info(name: str, info) -> gateway_pb2.ServiceStatus:
    """A peer's status for the public GetServerInfo: never its address (the engines must not be
    reachable from outside, and a client has no use for where they are)."""
    return gateway_pb2.ServiceStatus(
        name=name, reachable=True, model=info.model, device=info.device, dtype=info.dtype,
        max_model_len=info.max_model_len, num_running=info.num_running, kv=_kv_pb(info.kv),
        memory_plan_json=info.memory_plan_json,
    )


async def _peer_status(client, name: str) -> gateway_pb2.ServiceStatus:
    loop = asyncio.get_running_loop()
    try:
        info = await loop.run_in_executor(None, lambda: client.info(timeout=2.0))
    except Exception as e:  # the detail names the peer's address: logged, not handed to clients
        code = e.code() if hasattr(e, "code") and callable(e.code) else None
        log.debug("gateway: %s GetInfo failed: %s", name, e.details() if hasattr(e, "details") else e)
        why = f"{code.name}: the {name} does not answer" if code is not None else f"the {name} does not answer"
        return gateway_pb2.ServiceStatus(name=name, reachable=False, error=why)
    return _status_from_info(name, info)


def _wait_for_verifier(verifier: GrpcVerifier, timeout: float):
    end = time.monotonic() + timeout
    last = None
    while time.monotonic() < end:
        try:
            return verifier.info(timeout=min(10.0, max(0.1, end - time.monotonic())), wait_for_ready=True)
        except Exception as e:  # not up yet: keep waiting until the deadline
            last = e
            time.sleep(0.2)
    raise RuntimeError(f"the verifier at {verifier.address} did not answer within {timeout:.0f}s: {error_text(last)}")


def build_split(args) -> Gateway:
    from specsplit.models.loader import load_tokenizer

    internal = ClientSecurity.from_args(args, "internal_")
    keepalive = keepalive_options(args.keepalive_time, args.keepalive_timeout)
    verifier = GrpcVerifier(args.verifier, timeout=args.verifier_timeout, security=internal, keepalive=keepalive)
    log.info("gateway: waiting for the verifier at %s (up to %.0fs)", args.verifier, args.connect_timeout)
    vinfo = _wait_for_verifier(verifier, args.connect_timeout)
    log.info("gateway: verifier serves %s (vocab %d, max_model_len %d, max_num_seqs %d, KV %d/%d blocks free)",
             vinfo.model, vinfo.vocab_size, vinfo.max_model_len, vinfo.max_num_seqs, vinfo.kv.free_blocks, vinfo.kv.num_blocks)
    tok_dir = args.tokenizer or vinfo.tokenizer_dir
    log.info("gateway: tokenizer from %s%s", tok_dir, "" if args.tokenizer else " (reported by the verifier)")
    tokenizer = Tokenizer(load_tokenizer(tok_dir))

    kv = []
    if vinfo.kv.paged and vinfo.kv.num_blocks:
        kv.append(KvBudget("verifier", vinfo.kv.num_blocks, vinfo.kv.block_size, vinfo.kv.prefix_caching))
    drafter = None
    draft_model = ""
    unreachable: Exception | None = None
    if args.drafter:
        drafter = GrpcDrafter(args.drafter, timeout=args.drafter_timeout, security=internal, keepalive=keepalive)
        try:
            dinfo = drafter.info(timeout=args.drafter_connect_timeout, wait_for_ready=True)
            draft_model = dinfo.model
            if dinfo.vocab_size and dinfo.vocab_size != vinfo.vocab_size:
                raise ValueError(f"the drafter's vocabulary ({dinfo.vocab_size}) differs from the verifier's "
                                 f"({vinfo.vocab_size}); they must share a tokenizer")
            log.info("gateway: drafter at %s serves %s", args.drafter, dinfo.model)
            if dinfo.kv.paged and dinfo.kv.num_blocks:
                kv.append(KvBudget("drafter", dinfo.kv.num_blocks, dinfo.kv.block_size))
        except ValueError:
            raise
        except Exception as e:
            log.warning("gateway: drafter at %s not reachable yet (%s); target-only until it answers", args.drafter,
                        e.details() if hasattr(e, "details") else e)
            unreachable = e
    spec = spec_config(args, None if drafter is None else draft_model, device=vinfo.device, split=True)
    k = spec.num_speculative_tokens
    costs = None
    if spec.k_policy == "auto" and drafter is not None and k > 0:
        costs = _split_costs(verifier, drafter, vinfo, dinfo if draft_model else None, args.verifier_timeout)
    decoder = SpecDecoder(verifier, drafter if k > 0 else None, spec, max_model_len=vinfo.max_model_len, costs=costs)
    if unreachable is not None and decoder.drafter is not None:
        # down from the start: a step probes it (and re-syncs) before any call, and health says so
        decoder.health.failed(unreachable, decoder.tracks)
    if decoder.drafter is None:
        kv = [b for b in kv if b.name != "drafter"]
    max_num_seqs = args.max_num_seqs
    if vinfo.max_num_seqs and max_num_seqs > vinfo.max_num_seqs:
        log.warning("gateway: --max-num-seqs %d exceeds the verifier's %d (its KV cache is sized for that); using %d",
                    max_num_seqs, vinfo.max_num_seqs, vinfo.max_num_seqs)
        max_num_seqs = vinfo.max_num_seqs

    shrunk: list[str] = []  # set once by engine_health: why this gateway can no longer admit correctly

    def engine_health() -> str | None:
        try:
            info = verifier.info(timeout=HEALTH_PROBE_S)
        except Exception:
            return "the verifier does not answer"
        if not info.serving:
            return "the verifier reports NOT_SERVING"
        why = limits_shrunk(vinfo, info, max_num_seqs)  # admission was sized from vinfo
        if why is not None:
            if not shrunk:
                log.error("gateway: the verifier now serves smaller limits than this gateway admits by (%s); exiting "
                          "so that a supervisor restarts the gateway with them", why)
                shrunk.append(why)
            return f"the verifier restarted with smaller limits ({why})"
        return None

    async def fatal() -> str | None:  # admission sized from limits the verifier no longer has: restart
        while not shrunk:
            await asyncio.sleep(HEALTH_PROBE_S)
        return f"the verifier restarted with smaller limits than this gateway admits by ({shrunk[0]})"

    async def services():
        out = [await _peer_status(verifier, "verifier")]
        if drafter is not None:
            out.append(await _peer_status(drafter, "drafter"))
        return out

    return Gateway(
        decoder=decoder, tokenizer=tokenizer, eos_token_ids=tuple(vinfo.eos_token_ids),
        limits=Limits(vinfo.vocab_size, vinfo.max_model_len, frozenset(vinfo.sampling_features)),
        max_num_seqs=max_num_seqs, max_queue=args.max_queue,
        mode="split", target_model=vinfo.model, draft_model=draft_model or (UNKNOWN if args.drafter else ""),
        services=services, timing_sources=[c for c in (verifier, drafter) if c is not None],
        kv=kv, engine_health=engine_health, fatal=fatal,
        # Admission compiles with the gateway's tokenizer (a bad grammar is refused here); the
        # verifier compiles the same text again for its matchers, in its own cache.
        grammars=GrammarCompiler(tokenizer.tokenizer, vinfo.vocab_size, tuple(vinfo.eos_token_ids),
                                 timeout_s=getattr(args, "grammar_timeout", DEFAULT_COMPILE_TIMEOUT_S)),
    )


# A verifier's KV blocks may differ a little between start-ups of the same flags (the memory
# profile); a smaller cache only makes its adds wait (RESOURCE_EXHAUSTED, which admission handles).
# Past this shrink it is another configuration.
KV_SHRINK_TOLERANCE = 0.10


def limits_shrunk(admitted_by, now, max_num_seqs: int) -> str | None:
    """Why a verifier's current ServiceInfo (`now`) cannot serve what a gateway admits by the one it
    read at start (`admitted_by`): another vocabulary or KV block size, a smaller max_model_len, fewer
    sequences than the gateway admits, a KV cache more than KV_SHRINK_TOLERANCE smaller, or sampling
    features it admitted requests with that it no longer applies (an older version). None
    when it can (the same limits, or larger ones: those are only left unused)."""
    why = []
    if now.vocab_size != admitted_by.vocab_size:
        why.append(f"vocab_size {admitted_by.vocab_size} -> {now.vocab_size}")
    if now.max_model_len < admitted_by.max_model_len:
        why.append(f"max_model_len {admitted_by.max_model_len} -> {now.max_model_len}")
    if now.max_num_seqs and now.max_num_seqs < max_num_seqs:
        why.append(f"max_num_seqs {now.max_num_seqs}, this gateway admits {max_num_seqs}")
    lost = [f for f in admitted_by.sampling_features if f not in now.sampling_features]
    if lost:
        why.append(f"sampling features {', '.join(lost)} no longer applied (an older verifier)")
    if admitted_by.kv.paged and admitted_by.kv.num_blocks:
        if now.kv.block_size != admitted_by.kv.block_size:
            why.append(f"KV block size {admitted_by.kv.block_size} -> {now.kv.block_size}")
        elif now.kv.num_blocks < (1 - KV_SHRINK_TOLERANCE) * admitted_by.kv.num_blocks:
            why.append(f"KV blocks {admitted_by.kv.num_blocks} -> {now.kv.num_blocks}")
    return ", ".join(why) or None


def _split_costs(verifier, drafter, vinfo, dinfo, timeout: float) -> StepCosts | None:
    """The engines' calibrated costs (from GetInfo) plus the network: the median round trip of an
    engine call on this link, added to each verify and each propose call by the K policy. Without
    the verifier's costs (an older verifier) the policy is off and K stays fixed."""
    if not vinfo.step_costs:
        log.warning("gateway: the verifier reports no step costs; speculation uses a fixed K")
        return None
    trips = []
    for _ in range(5):
        t0 = time.perf_counter()
        verifier.info(timeout=timeout)
        trips.append(time.perf_counter() - t0)
    costs = StepCosts.from_rows(vinfo.step_costs, dinfo.step_costs if dinfo is not None else (),
                                statistics.median(trips))
    log.info("gateway: K policy on; step costs %s; network %.2f ms per engine call", costs.describe(),
             1e3 * costs.network_s)
    return costs


def run_split(args) -> int:
    import torch

    torch.set_num_threads(1)  # the gateway computes nothing heavy
    gw = build_split(args)
    return asyncio.run(run(gw, args))


# ---- colocated mode --------------------------------------------------------------------------
def build_colocated_gateway(args) -> Gateway:
    from specsplit.defaults import engine_config
    from specsplit.factory import build_colocated

    target = engine_config(args, args.target)
    draft = engine_config(args, args.draft, args.draft_device) if args.draft else None
    spec = spec_config(args, args.draft)
    colo = build_colocated(target, draft, spec, show_progress=False)
    cfg = colo.target_model.config
    metrics.watch_kv("verifier", colo.target)
    if colo.drafter is not None:
        metrics.watch_kv("drafter", colo.drafter)
    joint = plan_to_dict(colo)
    lookahead = spec.num_speculative_tokens + 1
    engines = [("verifier", colo.target, target, args.target)]
    if colo.drafter is not None:
        engines.append(("drafter", colo.drafter, draft, args.draft))
    plans = {name: (joint or static_plan(engine, c, lookahead)) for name, engine, c, _ in engines}
    for name, engine, c, model in engines:
        bm = getattr(engine, "block_manager", None)
        log.info("serve: %s %s on %s, KV %s", name, model, c.device,
                 f"{bm.num_blocks} blocks x {bm.block_size} tokens" if bm else "none")

    async def services():
        out = []
        for name, engine, c, model in engines:
            out.append(gateway_pb2.ServiceStatus(
                name=name, reachable=True, model=model, device=str(c.device), dtype=str(c.dtype).replace("torch.", ""),
                max_model_len=c.max_model_len, num_running=engine.num_running, kv=kv_stats(engine, gateway_pb2.KvBlocks),
                memory_plan_json=json.dumps(plans[name], sort_keys=True),
            ))
        return out

    tp = getattr(colo.target, "tensor_parallel", None)  # specsplit.parallel.group.TPGroup, or None

    def engine_health() -> str | None:
        return f"the tensor-parallel group failed: {tp.failed}" if tp is not None and tp.failed else None

    async def fatal() -> str | None:  # a dead TP group is permanent: exit non-zero, be restarted
        if tp is None:
            return None
        while not tp.failed:
            await asyncio.sleep(0.1)
        return engine_health()

    return Gateway(
        decoder=colo.decoder, tokenizer=Tokenizer(colo.tokenizer), eos_token_ids=tuple(colo.eos_token_ids),
        limits=Limits(cfg.vocab_size, args.max_model_len), max_num_seqs=args.max_num_seqs, max_queue=args.max_queue,
        mode="colocated", target_model=args.target, draft_model=args.draft or "", services=services,
        grammars=_colocated_grammars(colo, args), engine_health=engine_health, fatal=fatal,
    )


def _colocated_grammars(colo, args):
    """The verifier's grammar compiler (one cache: what the gateway compiles at admission, the
    step thread finds), bounded by --grammar-timeout."""
    grammars = getattr(colo.target, "grammars", None)
    if grammars is not None and getattr(args, "grammar_timeout", None):
        grammars.timeout_s = args.grammar_timeout
    return grammars


def run_colocated(args) -> int:
    from specsplit.factory import set_threads

    set_threads(args.threads)
    gw = build_colocated_gateway(args)
    return asyncio.run(run(gw, args))
