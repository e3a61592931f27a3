"""`specsplit bench async`: does pre-drafting pay? (issue #15's arms, in one interleaved run)

Two `specsplit up` stacks, each engine on its own core with one torch thread (verifier on the
first CPU, drafter and gateway on the second): one with asynchronous pre-drafting (the split
default), one lockstep (`--no-async-draft`). Beside them, in this process, the colocated engines
on one thread: target-only, speculative lockstep in the default
configuration (the served draft, the K policy), and pre-drafting in one process (a second
thread, one torch thread each). Batch 1: every arm runs each prompt in turn,
repeat by repeat (drift hits all alike); per prompt the median run is kept. Target-only on two
threads runs after them, on its own (OpenMP's spinning second thread slowed the arms after it). Then a concurrency
sweep through the pre-drafting stack: speculation as served against the same stack with
speculation disabled per request (`speculation.disable`), batch by batch alternating.

Every speculative arm's greedy tokens are compared with target-only's (`same_tokens`), and the
pre-drafting stack's branch hits and misses are read from its ServerInfo.
"""
from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from typing import Callable

import torch

from specsplit.bench.arms import Arm, ArmResult, Timing, colocated_arm, run_interleaved
from specsplit.config import EngineConfig, SpecConfig, parse_dtype
from specsplit.defaults import DEFAULT_DRAFT_MODEL_TOKENS, DEFAULT_DRAFT_STOP, bench_hybrid, default_k_for
from specsplit.factory import build_colocated


def _threads_arm(name: str, arm: Arm, threads: int) -> Arm:
    """`arm` run with `threads` torch threads (restored after each run)."""
    def once(p: list[int], tag: str) -> Timing:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return arm.once(p, tag)
        finally:
            torch.set_num_threads(before)

    return Arm(name, once, arm.k, {**arm.extra, "threads": threads})


def _split_arm(name: str, stub, new_tokens: int, disable: bool = False, timeout: float = 900.0) -> Arm:
    from specsplit.bench.split_arm import timed_generate
    from specsplit.gateway.bench_client import policy_costs, prefix_caching

    # the stack's K policy prices from its own start-up calibration: whether it drafts much depends on it
    return Arm(name, lambda p, tag: timed_generate(stub, p, new_tokens, 0, timeout, disable=disable)[0], 0,
               {"mode": "split", "speculation": not disable, "prefix_caching": prefix_caching(stub),
                "calibration": policy_costs(stub)})


def _pinning() -> tuple[str, str]:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise RuntimeError("bench async needs two CPUs: one for the verifier, one for the drafter")
    return str(cpus[0]), str(cpus[1])


def concurrency_sweep(stub, prompts: list[list[int]], new_tokens: int, levels: list[int], repeats: int,
                      progress: Callable[[], None] | None = None, timeout: float = 900.0,
                      measure: Callable[[bool], AbstractContextManager] | None = None) -> list[dict]:
    """Per level: tokens/s with speculation as served and with it disabled per request, through
    the same stack, alternating batch by batch (which goes first alternates too). measure(disable),
    if given, is entered around each batch (outside its timing), e.g. to read the stack's counters
    per arm (tools/split_streams_check.py)."""
    from specsplit.bench.split_arm import timed_generate

    rows = []
    for c in levels:
        tok = {False: 0, True: 0}
        wall = {False: 0.0, True: 0.0}
        with ThreadPoolExecutor(c) as pool:
            for j in range(repeats):
                batch = [prompts[(j * c + i) % len(prompts)] for i in range(c)]
                for disable in ((False, True) if j % 2 == 0 else (True, False)):
                    with measure(disable) if measure is not None else nullcontext():
                        t0 = time.perf_counter()
                        runs = list(pool.map(lambda p: timed_generate(stub, p, new_tokens, 0, timeout, t0,
                                                                       disable=disable)[0], batch))
                    wall[disable] += max(t.total_s for t in runs)
                    tok[disable] += sum(t.tokens for t in runs)
                if progress:
                    progress()
        spec, base = tok[False] / wall[False], tok[True] / wall[True]
        rows.append({"concurrency": c, "spec_tokens_per_s": spec, "target_only_tokens_per_s": base,
                     "speedup_vs_target_only": spec / base, "spec_tokens": tok[False], "target_only_tokens": tok[True]})
    return rows


def run(args, prompts_of: Callable, progress: Callable[[], None] | None = None) -> dict:
    """The async suite; `prompts_of(colo)` gives the prompts (held-out ShareGPT, chat template)."""
    from specsplit.bench.split_arm import UP_FLAGS
    from specsplit.gateway.bench_client import branch_counts, gateway_stub
    from specsplit.gateway.launch import specsplit_up

    draft = args.draft if args.no_hybrid else bench_hybrid(args.draft) or args.draft
    dtype = getattr(args, "dtype", "fp32")
    new_tokens, repeats = args.new_tokens or 64, args.repeats or 3
    max_prefill = min(512, args.max_model_len // 2)
    levels = [int(c) for c in (args.concurrency or "2,4,16,32").split(",") if int(c) > 1]
    top = max(levels, default=1)

    def cfg(model: str, max_num_seqs: int = 1) -> EngineConfig:
        return EngineConfig(model=model, dtype=parse_dtype(dtype), max_model_len=args.max_model_len,
                            max_num_seqs=max_num_seqs, max_prefill_tokens=max_prefill, prefix_caching=False)

    torch.set_num_threads(1)
    k = default_k_for(draft)
    base = build_colocated(cfg(args.target), None, SpecConfig(num_speculative_tokens=0), show_progress=False)
    prompts = prompts_of(base)
    lock = build_colocated(cfg(args.target), cfg(draft), SpecConfig(num_speculative_tokens=k, k_policy="auto", draft_stop=DEFAULT_DRAFT_STOP,
                           draft_model_tokens=DEFAULT_DRAFT_MODEL_TOKENS), show_progress=False)
    # One process, pre-drafting on a second thread (one torch thread each, so two cores).
    colo_async = build_colocated(cfg(args.target), cfg(draft), SpecConfig(num_speculative_tokens=k, k_policy="auto", draft_stop=DEFAULT_DRAFT_STOP,
                                 draft_model_tokens=DEFAULT_DRAFT_MODEL_TOKENS, async_draft=True), show_progress=False)
    vcpu, dcpu = _pinning()
    common = dict(dtype=dtype, max_model_len=args.max_model_len, max_num_seqs=max(top, 1), threads=1)
    pins = ["--verifier-cpus", vcpu, "--drafter-cpus", dcpu, "--gateway-cpus", dcpu,
            "--max-prefill-tokens", str(max_prefill), *UP_FLAGS]
    report: dict = {"draft": draft, "k_max": k, "new_tokens": new_tokens, "repeats": repeats,
                    "num_prompts": len(prompts), "pinning": {"verifier": vcpu, "drafter": dcpu, "gateway": dcpu}}
    try:
        with specsplit_up(args.target, draft, extra=pins, **common) as up_async, \
                specsplit_up(args.target, draft, extra=pins + ["--no-async-draft"], **common) as up_lock, \
                gateway_stub(up_async.address) as stub_async, gateway_stub(up_lock.address) as stub_lock:
            target1 = colocated_arm("target-only, colocated, 1 thread", base, new_tokens, mode="colocated")
            arms = [
                target1,
                colocated_arm(f"speculative lockstep, colocated, 1 thread ({draft})", lock, new_tokens, mode="colocated"),
                colocated_arm(f"colocated async ({draft}), 1 thread per engine", colo_async, new_tokens,
                              mode="colocated"),
                _split_arm(f"split async ({draft}), 1 thread per engine", stub_async, new_tokens),
                _split_arm(f"split lockstep ({draft}), 1 thread per engine", stub_lock, new_tokens),
                _split_arm("target-only through the split stack", stub_async, new_tokens, disable=True),
            ]
            before = branch_counts(stub_async)
            results = run_interleaved(arms, prompts, repeats, progress)
            after = branch_counts(stub_async)
            # Two threads last, on its own: OpenMP's second thread keeps spinning after each run
            # and slowed the one-thread arms interleaved after it (81 ms per token instead of 63).
            two = _threads_arm("target-only, colocated, 2 threads",
                               colocated_arm("t2", base, new_tokens, mode="colocated"), 2)
            results.insert(1, run_interleaved([two], prompts, repeats, progress)[0])
            hits, misses = after[0] - before[0], after[1] - before[1]
            rows = _rows(results)
            report["batch1"] = rows
            report["branch_hits"], report["branch_misses"] = hits, misses
            report["branch_hit_rate"] = hits / (hits + misses) if hits + misses else None
            report["concurrency"] = concurrency_sweep(stub_async, prompts, new_tokens, levels, max(2, repeats // 2 + 1),
                                                      progress) if levels else []
    finally:
        for colo in (base, lock, colo_async):
            colo.close()
    return report


def _rows(results: list[ArmResult]) -> list[dict]:
    rows = [r.summary() for r in results]
    outputs = [[t.output for t in r.timings] for r in results]
    t1 = rows[0]["tokens_per_s"]
    by_name = {row["arm"]: row for row in rows}
    colo_lock = next(row for row in rows if row["arm"].startswith("speculative lockstep"))
    for row, out in zip(rows, outputs):
        row["speedup_vs_target_only_1_thread"] = row["tokens_per_s"] / t1
        row["speedup_vs_target_only_2_threads"] = row["tokens_per_s"] / by_name["target-only, colocated, 2 threads"]["tokens_per_s"]
        row["ratio_vs_colocated_lockstep"] = row["tokens_per_s"] / colo_lock["tokens_per_s"]
        row["same_tokens_as_target_only"] = out == outputs[0]
        row.pop("per_position_acceptance", None)
    return rows


def format_report(report: dict) -> str:
    lines = [f"bench async: draft {report['draft']} (K <= {report['k_max']}), {report['num_prompts']} prompts x "
             f"{report['new_tokens']} tokens, {report['repeats']} repeats, pinned {report['pinning']}",
             f"{'arm':58s} {'tok/s':>7s} {'vs t1':>6s} {'vs t2':>6s} {'vs colo-lock':>12s} same"]
    for r in report["batch1"]:
        lines.append(f"{r['arm']:58s} {r['tokens_per_s']:7.1f} {r['speedup_vs_target_only_1_thread']:6.2f} "
                     f"{r['speedup_vs_target_only_2_threads']:6.2f} {r['ratio_vs_colocated_lockstep']:12.2f} "
                     f"{r['same_tokens_as_target_only']}")
    rate = report.get("branch_hit_rate")
    lines.append(f"pre-drafted branches (batch 1): {report['branch_hits']} hits, {report['branch_misses']} misses"
                 + (f", hit rate {rate:.2f}" if rate is not None else ""))
    for r in report.get("concurrency", []):
        lines.append(f"concurrency {r['concurrency']:3d}: split async {r['spec_tokens_per_s']:7.1f} tok/s, target-only "
                     f"(same stack) {r['target_only_tokens_per_s']:7.1f} tok/s: {r['speedup_vs_target_only']:.2f}x")
    return "\n".join(lines)

