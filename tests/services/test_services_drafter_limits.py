"""A drafter that cannot hold some sequences: they decode target-only, each alone, and every other
sequence keeps speculating (the drafter is not "down"). A drafter with a smaller --max-model-len
than the verifier's (a prompt past it, or a sequence growing past it), and one whose whole KV
cache (--num-blocks) cannot hold a request's prompt + max_tokens although its prompt is within
the drafter's max_model_len (before: the request was refused INVALID_ARGUMENT). Real processes:
verifier (max_model_len 256) + drafter (64) + gateway, tiny models."""
from __future__ import annotations

import random
import threading

import grpc
import pytest

from specsplit.gateway.generate_client import collect
from specsplit.v1 import gateway_pb2_grpc
from tests.services.procs import HOST, DRAFTER_JOINS, SPECULATE_ALWAYS, TINY_ENGINE, ServiceProcess, Stack, free_port, request, \
    server_info

DRAFTER_LEN = 64


def _stack(log_dir, tiny_llama, tiny_draft_close, drafter_extra=()) -> Stack:
    vport, dport, gport = free_port(), free_port(), free_port()
    stack = Stack()
    stack.procs["verifier"] = ServiceProcess("verifier", ["verifier", "--model", str(tiny_llama), "--port", str(vport),
                                                          "--max-num-seqs", "4", *TINY_ENGINE], log_dir, vport)
    stack.procs["drafter"] = ServiceProcess(
        "drafter", ["drafter", "--model", str(tiny_draft_close), "--port", str(dport), "--max-num-seqs", "4",
                    *TINY_ENGINE, "--max-model-len", str(DRAFTER_LEN), *drafter_extra], log_dir, dport)
    stack.procs["gateway"] = ServiceProcess(
        "gateway", ["gateway", "--verifier", f"{HOST}:{vport}", "--drafter", f"{HOST}:{dport}", "--port", str(gport),
                    "--max-num-seqs", "4", "--drafter-timeout", "10", *DRAFTER_JOINS, *SPECULATE_ALWAYS, "--num-speculative-tokens", "2"],
        log_dir, gport)
    return stack


@pytest.fixture(scope="module")
def short_drafter_stack(tmp_path_factory, tiny_llama, tiny_draft_close):
    stack = _stack(tmp_path_factory.mktemp("short-drafter"), tiny_llama, tiny_draft_close)
    try:
        yield stack.ready()
    finally:
        stack.stop()


def _streams(stack, cases: dict, first: str, rest: tuple[str, ...], timeout: float) -> dict:
    """Greedy streams through the gateway, one per case (name -> (prompt ids, max_tokens)): `first`
    alone until its first message arrives, then the `rest` beside it. -> name -> collected output."""
    outs: dict = {}
    started = threading.Event()

    def run(name):
        ids, n = cases[name]
        msgs = []
        with grpc.insecure_channel(stack.gateway) as ch:
            for m in gateway_pb2_grpc.GatewayStub(ch).Generate(request(ids, max_tokens=n, ignore_eos=True),
                                                               timeout=timeout):
                msgs.append(m)
                started.set()
        outs[name] = collect(msgs)

    threads = [threading.Thread(target=run, args=(first,))]
    threads[0].start()
    assert started.wait(60)
    threads += [threading.Thread(target=run, args=(n,)) for n in rest]
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join(timeout + 60)
    return outs


def test_only_the_sequence_the_drafter_cannot_hold_goes_target_only(short_drafter_stack, expect_greedy):
    stack = short_drafter_stack
    rng = random.Random(7)
    cases = {
        "long": ([rng.randrange(3, 256) for _ in range(100)], 20),  # prompt past the drafter's 64
        "grows": ([rng.randrange(3, 256) for _ in range(40)], 40),  # passes 64 while it decodes
        "short": ([rng.randrange(3, 256) for _ in range(8)], 40),  # always fits
    }
    # the long one runs first: before, its refusal turned the drafter "down"
    outs = _streams(stack, cases, "long", ("grows", "short"), timeout=120)
    for name, (ids, n) in cases.items():
        expect_greedy(ids, outs[name]["token_ids"], n, ignore_eos=True)
    assert outs["long"]["usage"]["proposed_draft_tokens"] == 0
    assert outs["grows"]["usage"]["proposed_draft_tokens"] > 0
    assert outs["short"]["usage"]["proposed_draft_tokens"] > 0
    log = stack["gateway"].log_tail(400)
    assert "drafter failed" not in log, log
    assert "does not fit the drafter's max_model_len 64" in log
    assert server_info(stack.gateway).drafter_up


# The drafter: 12 blocks of 16 (192 tokens; --num-blocks overrides the plan's cap of one 64-token
# sequence per --max-num-seqs) and at most one sequence per session, which it enforces itself.
DRAFTER_BLOCKS = 12


@pytest.fixture(scope="module")
def small_cache_stack(tmp_path_factory, tiny_llama, tiny_draft_close):
    stack = _stack(tmp_path_factory.mktemp("small-cache-drafter"), tiny_llama, tiny_draft_close,
                   ("--num-blocks", str(DRAFTER_BLOCKS), "--max-num-seqs", "1"))
    try:
        yield stack.ready()
    finally:
        stack.stop()


def test_sequences_the_drafter_refuses_go_target_only_alone(small_cache_stack, expect_greedy):
    """"long": its prompt is within the drafter's max_model_len, but prompt + max_tokens is more
    than the drafter's whole cache (the gateway finds it at submit; before, the request was refused
    INVALID_ARGUMENT). "a" and "b": whichever the drafter is given second, it refuses itself
    (RESOURCE_EXHAUSTED: one sequence per session). Those two decode target-only; the other short
    one speculates, with drafts accepted; every output is the target's greedy one."""
    stack = small_cache_stack
    rng = random.Random(11)
    cases = {
        "long": ([rng.randrange(3, 256) for _ in range(40)], 160),  # 200 tokens: more than 192
        "a": ([rng.randrange(3, 256) for _ in range(8)], 40),
        "b": ([rng.randrange(3, 256) for _ in range(8)], 40),
    }
    outs = _streams(stack, cases, "a", ("b", "long"), timeout=180)  # "a" runs (on the drafter) while the others arrive
    assert set(outs) == set(cases), outs
    for name, (ids, n) in cases.items():
        expect_greedy(ids, outs[name]["token_ids"], n, ignore_eos=True)
    assert outs["long"]["usage"]["proposed_draft_tokens"] == 0
    proposed = sorted(outs[n]["usage"]["proposed_draft_tokens"] for n in ("a", "b"))
    assert proposed[0] == 0 and proposed[1] > 0, outs
    assert max(outs[n]["usage"]["accepted_draft_tokens"] for n in ("a", "b")) > 0
    log = stack["gateway"].log_tail(400)
    assert "drafter failed" not in log and "drafter late" not in log, log
    assert log.count("200 tokens can never fit: the drafter's whole KV cache holds 192 tokens") == 1, log
    assert log.count("the drafter refused it") == 1, log
    assert "each session may hold at most 1" in log, log
    assert server_info(stack.gateway).drafter_up
