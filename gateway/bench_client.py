"""The gRPC half of `specsplit bench`'s split arm: stream one generation through a gateway's
Generate and report what the stream carried (specsplit/bench/split_arm.py times it as the
colocated arms are timed; the bench itself never imports grpc).

Each prompt: `max_tokens=new_tokens`, `ignore_eos`, greedy, `top_p=1`, and
`speculation.num_speculative_tokens=K`. TTFT = time to the first response that carries tokens;
total = time to the last response; proposed / accepted and the per-position acceptance come from
the final `usage`.

Speculative steps: each response carries the drafts proposed and accepted in the step(s) behind
it (GenerateResponse.proposed_draft_tokens), and greedy requests get one response per decode step,
so the responses that proposed drafts are the speculative steps, as the colocated arms count them.
(A gateway older than those fields sends 0: no speculative steps are seen.) The responses that
carried tokens are the decode steps.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

from specsplit.v1 import gateway_pb2, gateway_pb2_grpc


@dataclass
class Streamed:
    """What one streamed generation carried, timed from its start."""

    total_s: float
    ttft_s: float
    output: list[int]
    proposed: int
    accepted: int
    spec_steps: int  # responses that proposed drafts
    decode_steps: int  # responses that carried tokens
    per_position: list[int] = field(default_factory=list)


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


def prefix_caching(stub) -> bool:
    """Whether an engine behind the gateway keeps a prefix cache (its GetServerInfo)."""
    info = stub.GetServerInfo(gateway_pb2.GetServerInfoRequest(), timeout=30)
    return any(s.kv.prefix_caching for s in info.services)


def policy_costs(stub) -> str | None:
    """The K policy's step costs behind the gateway as it prices steps now (start-up calibration,
    rescaled where the verify calls drifted), in the calibration log line's words plus the network
    round trip; None where K is fixed (no policy)."""
    from specsplit.calibration import StepCosts

    info = stub.GetServerInfo(gateway_pb2.GetServerInfoRequest(), timeout=30)
    if not info.verify_costs:
        return None
    costs = StepCosts.from_rows(info.verify_costs, info.draft_costs, info.network_s)
    return f"{costs.describe()}; network {1e3 * costs.network_s:.2f} ms"


def stream_generate(stub, prompt: list[int], new_tokens: int, k: int, timeout: float,
                    t0: float | None = None, disable: bool = False) -> Streamed:
    """One streamed generation. `t0`: the clock start (a batch's common start at concurrency > 1);
    default now. `disable`: target-only for this request."""
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
    return Streamed(done - t0, (first if first is not None else done) - t0, output, u.proposed_draft_tokens,
                    u.accepted_draft_tokens, spec_steps, steps,
                    per_position=list(u.accepted_per_position) if spec_steps else [])
