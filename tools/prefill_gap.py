"""Chunked prefill's goal (issue #24 item 2): one running stream while 8 prompts of 1,500 tokens
arrive; its largest inter-token gap, with and without a per-step token budget.

Starts two real split stacks (`specsplit up`: drafter, verifier, gateway on loopback), one with
`--max-num-batched-tokens 0` (every prompt whole in its first step: the behaviour before) and one
with the budget under test, then runs interleaved trials on them (one at a time, alternating which
goes first) and prints the medians as JSON. A trial: a greedy stream decodes; once it has sent 20
tokens, N prompts of L random token ids arrive at once (max_tokens 4 each); the window ends when
every one of them has finished. Reported per trial: the stream's largest gap between two token
messages inside the window, its median gap before the window (a step), the long prompts' time to
first token (median, max) and the time until all finished.

    python tools/prefill_gap.py --target smollm2-135m --budgets 512 --trials 3

Timing goals live here, never in tests (docs/testing.md).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import grpc

from specsplit.defaults import resolve_draft
from specsplit.gateway.launch import specsplit_up
from specsplit.v1 import gateway_pb2, gateway_pb2_grpc


def _stream(stub, ids, max_tokens, out: list, stop: threading.Event | None = None):
    """Read one Generate stream; out gets (arrival time, tokens) per token message."""
    call = stub.Generate(gateway_pb2.GenerateRequest(prompt_token_ids=ids, max_tokens=max_tokens, ignore_eos=True),
                         timeout=900)
    try:
        for m in call:
            if m.token_ids:
                out.append((time.perf_counter(), len(m.token_ids)))
            if stop is not None and stop.is_set():
                call.cancel()
                return
    except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.CANCELLED:
            raise


def trial(address: str, n: int, length: int, seed: int) -> dict:
    rng = random.Random(seed)
    with grpc.insecure_channel(address) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        running: list = []
        stop = threading.Event()
        reader = threading.Thread(target=_stream, args=(stub, [rng.randrange(100, 49000) for _ in range(24)], 1800,
                                                        running, stop), daemon=True)
        reader.start()
        while sum(c for _, c in running) < 20:
            if not reader.is_alive():
                raise RuntimeError("the running stream ended before the long prompts arrived")
            time.sleep(0.01)
        before = [b - a for (a, _), (b, _) in zip(running, running[1:])]
        outs: list[list] = [[] for _ in range(n)]
        arrive = time.perf_counter()
        longs = [threading.Thread(target=_stream, args=(stub, [rng.randrange(100, 49000) for _ in range(length)], 4,
                                                        outs[i]), daemon=True) for i in range(n)]
        for t in longs:
            t.start()
        for t in longs:
            t.join()
        done = time.perf_counter()
        stop.set()
        reader.join(60)
    times = [t for t, _ in running]
    window = [b - a for a, b in zip(times, times[1:]) if b > arrive and a < done]
    ttft = [o[0][0] - arrive for o in outs if o]
    return {"max_gap_s": max(window) if window else done - arrive, "step_before_s": statistics.median(before),
            "gaps_in_window": len(window), "ttft_median_s": statistics.median(ttft), "ttft_max_s": max(ttft),
            "all_done_s": done - arrive}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--draft", default=None, help="default: the target's shipped draft")
    p.add_argument("--budgets", default="512", help="comma-separated --max-num-batched-tokens values (0 = before)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=1500)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--log-dir", default="/tmp/prefill_gap")
    p.add_argument("--extra", default="--memory-budget 2GiB --max-num-seqs 12 --max-model-len 2048",
                   help="flags for `specsplit up` besides the budget")
    a = p.parse_args(argv)
    draft = resolve_draft(a.target, a.draft)
    budgets = [0] + [int(b) for b in a.budgets.split(",") if int(b) != 0]
    Path(a.log_dir).mkdir(parents=True, exist_ok=True)
    from contextlib import ExitStack

    results: dict[int, list[dict]] = {b: [] for b in budgets}
    with ExitStack() as stack:
        ups = {b: stack.enter_context(specsplit_up(a.target, draft, log=f"{a.log_dir}/up-{b}.log", log_level="INFO",
                                                   extra=[*a.extra.split(), "--max-num-batched-tokens", str(b)]))
               for b in budgets}
        for b, up in ups.items():  # warm up: one short trial each, not counted
            trial(up.address, 2, 64, seed=0)
        for i in range(a.trials):
            order = budgets if i % 2 == 0 else budgets[::-1]
            for b in order:
                r = trial(ups[b].address, a.prompts, a.prompt_len, seed=100 + i)
                results[b].append(r)
                print(json.dumps({"budget": b, "trial": i, **{k: round(v, 3) for k, v in r.items()}}), flush=True)
    summary = {str(b): {k: round(statistics.median(r[k] for r in rs), 3) for k in rs[0]} for b, rs in results.items()}
    print(json.dumps({"target": a.target, "draft": draft, "prompts": a.prompts, "prompt_len": a.prompt_len,
                      "trials": a.trials, "medians": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
