"""The split arm of `specsplit bench`: the same prompts streamed through a gateway's Generate,
timed the way specsplit.bench.arms.run_specsplit times the colocated arms.

Each prompt: `max_tokens=new_tokens`, `ignore_eos`, greedy, `top_p=1`, and
`speculation.num_speculative_tokens=K`. A warm-up request is discarded (it also opens the
channel, so connection set-up is never timed); at concurrency 1 each prompt runs `repeats` times
and the median (by total time) is kept. TTFT = time to the first response that carries tokens;
total = time to the last response; proposed / accepted and the per-position acceptance come from
the final `usage`.

Speculative steps: each response carries the drafts proposed and accepted in the step(s) behind
it (GenerateResponse.proposed_draft_tokens), and greedy requests get one response per decode step,
so the responses that proposed drafts are the speculative steps (Timing.steps), as the colocated
arms count them: `mean_accepted_length` and the per-position acceptance are comparable. (A
gateway older than those fields sends 0: steps = 0, and ArmResult.summary() reports None / [].)
The count of decode steps (responses that carried tokens) is kept as `decode_steps`.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Callable, Iterator

from specsplit.v1 import gateway_pb2, gateway_pb2_grpc
from specsplit.bench.arms import ArmResult, Timing, median_timing


def generate_request(prompt: list[int], new_tokens: int, k: int, disable: bool = False) -> gateway_pb2.GenerateRequest:
    req = gateway_pb2.GenerateRequest(max_tokens=new_tokens, temperature=0.0, top_p=1.0, ignore_eos=True)
    req.prompt_token_ids.extend(int(t) for t in prompt)
    req.speculation.num_speculative_tokens = k
    req.speculation.disable = disable
    return req


@contextmanager
def gateway_stub(address: str, security=None) -> Iterator[gateway_pb2_grpc.GatewayStub]:
    from specsplit.rpc.security import channel as make_channel

    with make_channel(address, security) as ch:
        yield gateway_pb2_grpc.GatewayStub(ch)


def branch_counts(stub) -> tuple[int, int]:
    """The gateway's pre-drafted branches so far: (hits, misses)."""
    info = stub.GetServerInfo(gateway_pb2.GetServerInfoRequest(), timeout=30)
    return info.branch_hits, info.branch_misses


def timed_generate(stub, prompt: list[int], new_tokens: int, k: int, timeout: float,
                   t0: float | None = None, disable: bool = False) -> tuple[Timing, int]:
    """One streamed generation -> (Timing, decode steps seen). `t0`: the clock start (a batch's
    common start at concurrency > 1); default now. `disable`: target-only for this request."""
    req = generate_request(prompt, new_tokens, k, disable)
    t0 = time.perf_counter() if t0 is None else t0
    first = None
    output: list[int] = []
    steps = 0
    spec_steps = 0
    last = None
    for msg in stub.Generate(req, timeout=timeout):
        if msg.token_ids:
            if first is None:
                first = time.perf_counter()
            steps += 1
            output.extend(msg.token_ids)
        spec_steps += msg.proposed_draft_tokens > 0
        last = msg
    done = time.perf_counter()
    if last is None or not last.finish_reason:
        raise RuntimeError("the gateway's stream ended without a final response (finish_reason, usage)")
    u = last.usage
    if u.completion_tokens != len(output):
        raise RuntimeError(f"usage says {u.completion_tokens} completion tokens, the stream carried {len(output)}")
    timing = Timing(done - t0, (first if first is not None else done) - t0, len(output), u.proposed_draft_tokens,
                    u.accepted_draft_tokens, steps=spec_steps,
                    per_position=list(u.accepted_per_position) if spec_steps else [], output=output)
    return timing, steps


def run_split(name: str, address: str, prompts: list[list[int]], new_tokens: int, repeats: int, k: int,
              concurrency: int = 1, progress: Callable[[], None] | None = None, timeout: float = 900.0,
              security=None) -> ArmResult:
    """Streams the prompts through the gateway at `address`; see the module docstring."""
    timings: list[Timing] = []
    decode_steps = 0
    with gateway_stub(address, security) as stub:
        timed_generate(stub, prompts[0], new_tokens, k, timeout)  # warm-up (discarded)
        if concurrency <= 1:
            for p in prompts:
                runs = [timed_generate(stub, p, new_tokens, k, timeout) for _ in range(repeats)]
                kept = median_timing([t for t, _ in runs])
                decode_steps += next(s for t, s in runs if t is kept)
                timings.append(kept)
                if progress:
                    progress()
            return ArmResult(name, timings, {"concurrency": 1, "k": k, "decode_steps": decode_steps})
        wall = 0.0
        with ThreadPoolExecutor(concurrency) as pool:
            for j in range(repeats):
                batch = [prompts[(j * concurrency + i) % len(prompts)] for i in range(concurrency)]
                t0 = time.perf_counter()
                runs = list(pool.map(lambda p: timed_generate(stub, p, new_tokens, k, timeout, t0), batch))
                wall += max(t.total_s for t, _ in runs)
                timings.extend(t for t, _ in runs)
                decode_steps += sum(s for _, s in runs)
                if progress:
                    progress()
    return ArmResult(name, timings, {"concurrency": concurrency, "k": k, "wall_s": wall, "decode_steps": decode_steps})


def split_arm(name: str, stub, new_tokens: int, k: int, timeout: float = 900.0):
    """The split arm as a specsplit.bench.arms.Arm (for run_interleaved) over an open Gateway stub.
    Returns (arm, steps): `steps` maps each Timing the arm produced (by id) to its decode steps."""
    from specsplit.bench.arms import Arm

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
    from specsplit.bench.arms import colocated_arm, run_interleaved

    with gateway_stub(address, security) as stub:
        split, steps = split_arm(name, stub, new_tokens, k, timeout)
        paired = colocated_arm(colo_name, colo, new_tokens, k, interleaved_with_split=True)
        colo_result, split_result = run_interleaved([paired, split], prompts, repeats, progress)
    split_result.extra["decode_steps"] = sum(steps[id(t)] for t in split_result.timings)
    return split_result, colo_result

