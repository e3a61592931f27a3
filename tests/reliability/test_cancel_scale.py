"""Cancellation at scale on the `plain` stack (max_num_seqs 8, max_queue 128): 100 streams, 10 of
them cancelled after their first message; the other 90 complete with exactly max_tokens tokens,
nothing stays running or waiting anywhere, every KV block is free again within 1 s, and a
cancelled request_id can be used again."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from specsplit.v1 import gateway_pb2_grpc
from tests.services.procs import generate, request, server_info, service_info, wait_for

STREAMS = 100
CANCELLED = 10
MAX_TOKENS = 12
CLEAN_WITHIN_S = 1.0


def _state(stack):
    v = service_info(stack["verifier"].address, "verifier")
    d = service_info(stack["drafter"].address, "drafter")
    g = server_info(stack.gateway)
    return {"gateway": g.num_running + g.num_waiting, "verifier": v.num_running, "drafter": d.num_running,
            "free": (v.kv.free_blocks, d.kv.free_blocks)}


def test_100_streams_10_cancelled(plain_stack, prompts):
    assert wait_for(lambda: _state(plain_stack)["verifier"] == 0, 10) is not None
    baseline = _state(plain_stack)
    channel = grpc.insecure_channel(plain_stack.gateway)
    stub = gateway_pb2_grpc.GatewayStub(channel)

    def run(i):
        req = request(prompts[i % len(prompts)], max_tokens=MAX_TOKENS, ignore_eos=True, request_id=f"scale-{i}")
        call = stub.Generate(req, timeout=120)
        ids, last = [], None
        try:
            for r in call:
                ids.extend(r.token_ids)
                last = r
                if i < CANCELLED:
                    call.cancel()
        except grpc.RpcError as e:
            return i, e.code(), ids, None
        return i, "ok", ids, last

    t0 = time.monotonic()
    with ThreadPoolExecutor(STREAMS) as pool:
        results = list(pool.map(run, range(STREAMS)))
    elapsed = time.monotonic() - t0
    t_end = time.monotonic()
    clean_s = wait_for(lambda: _state(plain_stack) == baseline, 10, poll=0.02)
    channel.close()
    cancelled = [r for r in results if r[0] < CANCELLED]
    done = [r for r in results if r[0] >= CANCELLED]
    exact = [r for r in done if r[1] == "ok" and len(r[2]) == MAX_TOKENS and r[3].usage.completion_tokens == MAX_TOKENS
             and r[3].finish_reason == "length"]
    print(f"FIGURE cancel: {STREAMS} streams in {elapsed:.1f}s, {len(cancelled)} cancelled "
          f"({sorted({str(getattr(c, 'name', c)) for _, c, *_ in cancelled})}), {len(exact)}/{len(done)} exact; "
          f"back to baseline {baseline} in {clean_s if clean_s is None else round(clean_s, 3)}s "
          f"(since the last stream ended, {time.monotonic() - t_end:.2f}s ago)")
    assert all(c == grpc.StatusCode.CANCELLED for _, c, *_ in cancelled), cancelled
    assert len(exact) == STREAMS - CANCELLED, [r[:2] for r in done if r not in exact]
    assert clean_s is not None and clean_s < CLEAN_WITHIN_S, (_state(plain_stack), baseline)
    # The request_id of a cancelled stream works again.
    out = generate(plain_stack.gateway, request(prompts[0], max_tokens=MAX_TOKENS, ignore_eos=True, request_id="scale-0"))
    assert len(out["token_ids"]) == MAX_TOKENS and out["finish_reason"] == "length"
    assert all(p.alive() for p in plain_stack.procs.values())
