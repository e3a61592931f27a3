"""Speculation vs target-only through one split stack at N streams, with where the time went.

`specsplit up` (verifier on one CPU, drafter and gateway on the other, the real models on
loopback), then rounds of batches of N concurrent greedy requests over held-out chat prompts:
in each round one batch speculating as served and one with speculation disabled per request
(`speculation.disable`), which goes first alternating. Reported per arm: tokens/s over the arm's
batches (wall time), and the stack's own Prometheus counters summed over the arm's batches (step
phases, engine calls, `specsplit_steps_total{k}`: the K the policy asked for). This is the
longer form of `specsplit bench async`'s two-stream check (ninth session: the policy's probes,
its one-draft steps and the cost of having speculation available, in README.md).

    python tools/split_streams_check.py --streams 2 --rounds 4 --new-tokens 64

Timing goals live here, never in tests (docs/testing.md).
"""
from __future__ import annotations

import argparse
import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

COUNTERS = ("specsplit_step_seconds_sum", "specsplit_step_seconds_count", "specsplit_steps_total",
            "specsplit_engine_seconds_sum", "specsplit_engine_seconds_count")


def parse_counters(text: str) -> dict[str, float]:
    """The COUNTERS samples of a Prometheus text page, by their full name with labels."""
    out = {}
    for line in text.splitlines():
        if line.startswith(COUNTERS):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--draft", default="smollm2-135m-eagle3+ngram")
    ap.add_argument("--streams", type=int, default=2)
    ap.add_argument("--batches", type=int, default=2, help="batches per arm per round")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--log", default=None, help="the stack's log file (INFO)")
    a = ap.parse_args()

    from specsplit.bench.split_arm import timed_generate
    from specsplit.bench.suite import heldout_prompts
    from specsplit.gateway.bench_client import gateway_stub
    from specsplit.gateway.launch import specsplit_up
    from specsplit.models.loader import hf_dir_for, load_tokenizer
    from specsplit.rpc.health import free_ports

    tokenizer = load_tokenizer(hf_dir_for(a.target, show_progress=False))
    prompts = heldout_prompts(tokenizer, a.streams * a.batches, 512, chat=True)
    metrics_port = free_ports(1, "127.0.0.1")[0]  # the gateway's; the engines take the next two

    def scrape() -> dict[str, float]:
        pages = [urllib.request.urlopen(f"http://127.0.0.1:{p}/metrics", timeout=5).read().decode()
                 for p in (metrics_port, metrics_port + 1, metrics_port + 2)]
        return parse_counters("\n".join(pages))

    pins = ["--verifier-cpus", "0", "--drafter-cpus", "1", "--gateway-cpus", "1", "--max-prefill-tokens", "512",
            "--metrics-port", str(metrics_port)]
    arms = {False: "speculative", True: "target-only"}
    tokens = {d: 0 for d in arms}
    wall = {d: 0.0 for d in arms}
    counters: dict[bool, dict[str, float]] = {d: {} for d in arms}
    with specsplit_up(a.target, a.draft, extra=pins, max_model_len=1024, max_num_seqs=a.streams, threads=1,
                      log=a.log, log_level="INFO" if a.log else "WARNING") as up, \
            gateway_stub(up.address) as stub, ThreadPoolExecutor(a.streams) as pool:

        def batches(disable: bool) -> tuple[int, float]:
            n, seconds = 0, 0.0
            for j in range(a.batches):
                batch = prompts[j * a.streams:(j + 1) * a.streams]
                t0 = time.perf_counter()
                runs = list(pool.map(lambda p: timed_generate(stub, p, a.new_tokens, 0, 600, t0, disable=disable)[0],
                                     batch))
                seconds += max(t.total_s for t in runs)
                n += sum(t.tokens for t in runs)
            return n, seconds

        batches(False), batches(True)  # warm-up, not counted
        for r in range(a.rounds):
            for disable in ((False, True) if r % 2 == 0 else (True, False)):
                before = scrape()
                n, seconds = batches(disable)
                for k, v in delta(scrape(), before).items():
                    counters[disable][k] = counters[disable].get(k, 0.0) + v
                tokens[disable] += n
                wall[disable] += seconds
    rate = {d: tokens[d] / wall[d] for d in arms}
    report = {"streams": a.streams, "rounds": a.rounds, "batches": a.batches, "new_tokens": a.new_tokens,
              "draft": a.draft, "speculative_vs_target_only": rate[False] / rate[True],
              "arms": {arms[d]: {"tokens_per_s": rate[d], "tokens": tokens[d], "counters": counters[d]} for d in arms}}
    print(json.dumps(report, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
