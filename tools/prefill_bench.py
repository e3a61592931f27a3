"""Issue #24's prefill goals, measured on real split stacks (`specsplit up`: drafter, verifier and
gateway on loopback), before and after:

  gap:  one running stream while 8 prompts of 1,500 tokens arrive; its largest inter-token gap
        (goal <= 1.0 s). A greedy stream decodes; once it has sent 20 tokens, N prompts of L random
        token ids arrive at once (max_tokens 4 each); the window ends when all of them finished.
        Also: its median gap before the window (a step), the long prompts' time to first token
        (median, max), the time until all finished.
  ttft: a request sharing a 1,000-token prefix with an earlier one; its time to first token over
        the first's (goal <= 0.3). Both: the prefix + 24 tokens of their own, max_tokens 1, one at a
        time; a fresh random prefix per trial.

"before" runs `--max-num-batched-tokens 0 --no-prefix-caching` (every prompt whole in its first
step, nothing reused: the tree before chunked prefill and prefix caching); "after" runs the
defaults (or --after-extra). The trials are interleaved (alternating which stack goes first);
medians are printed as JSON.

    python tools/prefill_bench.py --trials 3

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


def ttft_trial(address: str, prefix_len: int, seed: int) -> dict:
    rng = random.Random(seed)
    prefix = [rng.randrange(100, 49000) for _ in range(prefix_len)]
    out = {}
    with grpc.insecure_channel(address) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        for name in ("first", "second"):
            got: list = []
            t0 = time.perf_counter()
            _stream(stub, prefix + [rng.randrange(100, 49000) for _ in range(24)], 1, got)
            out[f"ttft_{name}_s"] = got[0][0] - t0
    out["ttft_ratio"] = out["ttft_second_s"] / out["ttft_first_s"]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--draft", default=None, help="default: the target's shipped draft")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=1500)
    p.add_argument("--prefix-len", type=int, default=1000)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--log-dir", default="/tmp/prefill_bench")
    p.add_argument("--extra", default="--memory-budget 2GiB --max-num-seqs 12 --max-model-len 2048",
                   help="flags for `specsplit up` in both stacks")
    p.add_argument("--before-extra", default="--max-num-batched-tokens 0 --no-prefix-caching")
    p.add_argument("--after-extra", default="")
    a = p.parse_args(argv)
    draft = resolve_draft(a.target, a.draft)
    Path(a.log_dir).mkdir(parents=True, exist_ok=True)
    from contextlib import ExitStack

    arms = {"before": a.before_extra.split(), "after": a.after_extra.split()}
    results: dict[str, list[dict]] = {name: [] for name in arms}
    with ExitStack() as stack:
        ups = {name: stack.enter_context(specsplit_up(a.target, draft, log=f"{a.log_dir}/up-{name}.log",
                                                      log_level="INFO", extra=[*a.extra.split(), *extra]))
               for name, extra in arms.items()}
        for up in ups.values():  # warm up: one short trial each, not counted
            trial(up.address, 2, 64, seed=0)
        for i in range(a.trials):
            for name in (list(arms) if i % 2 == 0 else list(arms)[::-1]):
                r = {**trial(ups[name].address, a.prompts, a.prompt_len, seed=100 + i),
                     **ttft_trial(ups[name].address, a.prefix_len, seed=200 + i)}
                results[name].append(r)
                print(json.dumps({"arm": name, "trial": i, **{k: round(v, 3) for k, v in r.items()}}), flush=True)
    summary = {name: {k: round(statistics.median(r[k] for r in rs), 3) for k in rs[0]} for name, rs in results.items()}
    print(json.dumps({"target": a.target, "draft": draft, "prompts": a.prompts, "prompt_len": a.prompt_len,
                      "prefix_len": a.prefix_len, "trials": a.trials, "arms": arms, "medians": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
