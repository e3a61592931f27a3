"""The split arm of `specsplit bench`: the same prompts streamed through a gateway
(specsplit.gateway.bench_client), timed the way specsplit.bench.arms times the colocated arms. A
warm-up request is discarded (it also opens the channel, so connection set-up is never timed); per
prompt the median (by total time) of `repeats` runs is kept. The count of decode steps (responses
that carried tokens) is kept as `decode_steps`.
"""
from __future__ import annotations

from typing import Callable

from specsplit.bench.arms import Arm, ArmResult, Timing, colocated_arm, run_interleaved
from specsplit.gateway.bench_client import gateway_stub, prefix_caching, stream_generate

# `specsplit up` flags every split stack of the bench runs with, so that it computes what the
# colocated arms compute: their engines keep no prefix cache (EngineConfig(prefix_caching=False)),
# so each repeat of a prompt computes it again. A stack with its default cache served the repeats'
# prompts from it, and its TTFT and tok/s beat the colocated arms' for that alone.
UP_FLAGS = ("--no-prefix-caching",)


def timed_generate(stub, prompt: list[int], new_tokens: int, k: int, timeout: float,
                   t0: float | None = None, disable: bool = False) -> tuple[Timing, int]:
    """One streamed generation -> (Timing, decode steps seen); see gateway.bench_client.stream_generate."""
    s = stream_generate(stub, prompt, new_tokens, k, timeout, t0, disable)
    timing = Timing(s.total_s, s.ttft_s, len(s.output), s.proposed, s.accepted, steps=s.spec_steps,
                    per_position=s.per_position, output=s.output)
    return timing, s.decode_steps


def split_arm(name: str, stub, new_tokens: int, k: int, timeout: float = 900.0):
    """The split arm as a specsplit.bench.arms.Arm (for run_interleaved) over an open Gateway stub.
    Returns (arm, steps): `steps` maps each Timing the arm produced (by id) to its decode steps."""
    steps: dict[int, int] = {}

    def once(p: list[int], tag: str) -> Timing:
        timing, n = timed_generate(stub, p, new_tokens, k, timeout)
        steps[id(timing)] = n
        return timing

    return Arm(name, once, k), steps


def run_split_paired(name: str, colo_name: str, address: str, colo, prompts: list[list[int]], new_tokens: int,
                     repeats: int, k: int, progress: Callable[[], None] | None = None, timeout: float = 900.0,
                     security=None) -> tuple[ArmResult, ArmResult]:
    """Split and colocated, interleaved run by run (colocated, then split, same prompt, same K), so
    both see the same machine: on shared CPUs the speed drifts by tens of percent over minutes,
    and arms timed minutes apart cannot give a ratio to a few percent. One warm-up each
    (discarded); per prompt the median of `repeats` runs of each. Returns (split, colocated)."""
    with gateway_stub(address, security) as stub:
        split, steps = split_arm(name, stub, new_tokens, k, timeout)
        paired = colocated_arm(colo_name, colo, new_tokens, k, interleaved_with_split=True)
        colo_result, split_result = run_interleaved([paired, split], prompts, repeats, progress)
        split_result.extra["prefix_caching"] = prefix_caching(stub)
    split_result.extra["decode_steps"] = sum(steps[id(t)] for t in split_result.timings)
    return split_result, colo_result

