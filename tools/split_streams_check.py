"""Speculation vs target-only through one split stack at N streams, with where the time went.

`specsplit up` (verifier on one CPU, drafter and gateway on the other, the real models on
loopback), then batches of N concurrent greedy requests over held-out chat prompts, each batch
once speculating as served and once with speculation disabled per request
(`speculation.disable`), batch by batch, which goes first alternating: the loop of `specsplit
bench async`'s two-stream check (bench/overlap.concurrency_sweep), run longer. Reported per arm:
tokens/s over the arm's batches (wall time), and the stack's own Prometheus counters summed over
the arm's batches (step phases, engine calls, `specsplit_steps_total{k}`: the K the policy asked
for; ninth session: the policy's probes, its one-draft steps and the cost of having speculation
available, in README.md).

    python tools/split_streams_check.py --streams 2 --rounds 4 --new-tokens 64

Timing goals live here, never in tests (docs/testing.md).
"""
from __future__ import annotations

import argparse
import json
from contextlib import contextmanager

from specsplit.rpc.metrics import parse_metrics

COUNTERS = ("specsplit_step_seconds_sum", "specsplit_step_seconds_count", "specsplit_steps_total",
            "specsplit_engine_seconds_sum", "specsplit_engine_seconds_count")


def counters(metrics: dict[str, float]) -> dict[str, float]:
    """The COUNTERS samples of a parsed /metrics page (rpc.metrics), by their full name with labels."""
    return {k: v for k, v in metrics.items() if k.startswith(COUNTERS)}


def parse_counters(text: str) -> dict[str, float]:
    """The COUNTERS samples of a Prometheus text page."""
    return counters(parse_metrics(text))


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--draft", default="smollm2-135m-eagle3+ngram")
    ap.add_argument("--streams", type=int, default=2)
    ap.add_argument("--batches", type=int, default=2, help="distinct batches of prompts (each arm runs each once a round)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--log", default=None, help="the stack's log file (INFO)")
    a = ap.parse_args()

    from specsplit.bench.overlap import concurrency_sweep
    from specsplit.bench.suite import heldout_prompts
    from specsplit.gateway.bench_client import gateway_stub
    from specsplit.gateway.launch import specsplit_up
    from specsplit.models.loader import hf_dir_for, load_tokenizer
    from specsplit.rpc.health import free_port_run
    from specsplit.rpc.metrics import read_metrics

    tokenizer = load_tokenizer(hf_dir_for(a.target, show_progress=False))
    prompts = heldout_prompts(tokenizer, a.streams * a.batches, 512, chat=True)
    metrics_port = free_port_run(3)  # the gateway's; the engines take the next two
    arms = {False: "speculative", True: "target-only"}
    by_arm: dict[bool, dict[str, float]] = {d: {} for d in arms}

    def scrape() -> dict[str, float]:
        return counters({k: v for p in (metrics_port, metrics_port + 1, metrics_port + 2)
                         for k, v in read_metrics(p).items()})

    @contextmanager
    def counted(disable: bool):
        """The stack's counters over one batch, added to its arm's."""
        before = scrape()
        yield
        for k, v in delta(scrape(), before).items():
            by_arm[disable][k] = by_arm[disable].get(k, 0.0) + v

    pins = ["--verifier-cpus", "0", "--drafter-cpus", "1", "--gateway-cpus", "1", "--max-prefill-tokens", "512",
            "--metrics-port", str(metrics_port)]
    with specsplit_up(a.target, a.draft, extra=pins, max_model_len=1024, max_num_seqs=a.streams, threads=1,
                      log=a.log, log_level="INFO" if a.log else "WARNING") as up, gateway_stub(up.address) as stub:
        concurrency_sweep(stub, prompts, a.new_tokens, [a.streams], 1)  # warm-up, not counted
        row = concurrency_sweep(stub, prompts, a.new_tokens, [a.streams], a.rounds * a.batches, measure=counted)[0]
    rate = {False: row["spec_tokens_per_s"], True: row["target_only_tokens_per_s"]}
    tokens = {False: row["spec_tokens"], True: row["target_only_tokens"]}
    report = {"streams": a.streams, "rounds": a.rounds, "batches": a.batches, "new_tokens": a.new_tokens,
              "draft": a.draft, "speculative_vs_target_only": row["speedup_vs_target_only"],
              "arms": {arms[d]: {"tokens_per_s": rate[d], "tokens": tokens[d], "counters": by_arm[d]} for d in arms}}
    print(json.dumps(report, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
