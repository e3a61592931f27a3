"""Soak on the `plain` stack (--disable-by-batch-size 4): 1,000 short requests in waves that
alternate 2 and 8 concurrent streams, so speculation turns off and on again many times. The
resident memory of each service and the free KV blocks stay flat (measured after a warm-up)."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from specsplit.v1 import gateway_pb2_grpc
from tests.services.procs import request, service_info, wait_for

REQUESTS = 1000
WARMUP = 200
WAVE = 20
RSS_BOUND_MIB = 8.0  # growth allowed per service between the end of warm-up and the end


def _rss_mib(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def _free(stack):
    return (service_info(stack["verifier"].address, "verifier").kv.free_blocks,
            service_info(stack["drafter"].address, "drafter").kv.free_blocks)


def test_soak_memory_flat(plain_stack, prompts):
    assert wait_for(lambda: service_info(plain_stack["verifier"].address, "verifier").num_running == 0, 10) is not None
    free0 = _free(plain_stack)
    pids = {n: p.proc.pid for n, p in plain_stack.procs.items()}
    channel = grpc.insecure_channel(plain_stack.gateway)
    stub = gateway_pb2_grpc.GatewayStub(channel)

    def one(i):
        r = list(stub.Generate(request(prompts[i % len(prompts)], max_tokens=4, ignore_eos=True), timeout=60))[-1]
        assert r.finish_reason == "length" and r.usage.completion_tokens == 4
        return r.usage.proposed_draft_tokens > 0

    spec_on = spec_off = 0
    rss_warm = None
    t0 = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        for start in range(0, REQUESTS, WAVE):
            width = 2 if (start // WAVE) % 2 == 0 else 8
            ids = list(range(start, start + WAVE))
            for b in range(0, WAVE, width):
                for speculated in pool.map(one, ids[b:b + width]):
                    spec_on += speculated
                    spec_off += not speculated
            if start + WAVE == WARMUP:
                rss_warm = {n: _rss_mib(pid) for n, pid in pids.items()}
    elapsed = time.monotonic() - t0
    channel.close()
    rss_end = {n: _rss_mib(pid) for n, pid in pids.items()}
    growth = {n: round(rss_end[n] - rss_warm[n], 1) for n in pids}
    free_ok = wait_for(lambda: _free(plain_stack) == free0, 5) is not None
    print(f"FIGURE soak: {REQUESTS} requests in {elapsed:.1f}s ({spec_on} speculated, {spec_off} target-only); "
          f"RSS MiB after warm-up {({n: round(v) for n, v in rss_warm.items()})}, growth to the end {growth} "
          f"(bound {RSS_BOUND_MIB:g}); free KV blocks {_free(plain_stack)} vs {free0}")
    assert spec_on > 0 and spec_off > 0  # crossed --disable-by-batch-size
    assert free_ok
    assert all(g < RSS_BOUND_MIB for g in growth.values()), growth
