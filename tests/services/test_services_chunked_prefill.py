"""Chunked prefill (--max-num-batched-tokens) and prefix caching over real gRPC: split (3
processes) and colocated.

A long prompt arriving beside a running stream is computed in pieces of a few tokens a step (the
verifier's VerifyItem.prefill_tokens, the drafter's ProposeItem.prefill_tokens); both streams equal
the target alone (up to certified near-ties), and a request cancelled between its pieces leaves
nothing allocated on either service. A shared prefix is reused on both engines (their metrics).
"""
from __future__ import annotations

import threading
import time

import grpc
import pytest

from specsplit.v1 import gateway_pb2_grpc
from tests.services.procs import generate, request, service_info, start_colocated, start_split, wait_for

BUDGET = 4  # tokens a step: a 200-token prompt takes 50 steps or more
FLAG = ("--max-num-batched-tokens", str(BUDGET))


@pytest.fixture(scope="module")
def stacks(tmp_path_factory, tiny_llama, tiny_draft_close):
    out = {
        "split": start_split(tmp_path_factory.mktemp("chunked-split"), tiny_llama, tiny_draft_close, gateway_extra=FLAG),
        "colocated": start_colocated(tmp_path_factory.mktemp("chunked-colocated"), tiny_llama, tiny_draft_close,
                                     extra=FLAG),
    }
    try:
        yield {name: s.ready() for name, s in out.items()}
    finally:
        for s in out.values():
            s.stop()


def _long_prompt(n: int) -> list[int]:
    return [3 + (j * 29) % 250 for j in range(n)]


@pytest.mark.parametrize("mode", ["split", "colocated"])
def test_long_prompt_beside_a_running_stream_equals_target(stacks, mode, prompts, expect_greedy):
    stack = stacks[mode]
    results: dict[str, dict] = {}
    running = threading.Thread(target=lambda: results.__setitem__(
        "running", generate(stack.gateway, request(prompts[0], max_tokens=60, ignore_eos=True))))
    running.start()
    time.sleep(0.05)
    long_ids = _long_prompt(200)
    results["long"] = generate(stack.gateway, request(long_ids, max_tokens=20, ignore_eos=True))
    running.join(60)
    expect_greedy(long_ids, results["long"]["token_ids"], 20, ignore_eos=True)
    expect_greedy(prompts[0], results["running"]["token_ids"], 60, ignore_eos=True)
    log = stack["gateway"].log_path.read_text(errors="replace")
    assert "200 prompt tokens are prefilled in pieces" in log and f"max_num_batched_tokens {BUDGET})" in log


def _engine_state(stack) -> list[tuple[int, int, int]]:
    """(running, free blocks, blocks) on the verifier and the drafter."""
    infos = [service_info(stack[r].address, r) for r in ("verifier", "drafter")]
    return [(i.num_running, i.kv.free_blocks, i.kv.num_blocks) for i in infos]


def test_cancel_between_pieces_frees_both_services(stacks):
    """Cancelled while its 240-token prompt is being computed (no token sent yet): the verifier
    and the drafter hold no sequence and every block is free again."""
    stack = stacks["split"]
    assert all(n == 0 and free == total for n, free, total in _engine_state(stack))
    with grpc.insecure_channel(stack.gateway) as ch:
        call = gateway_pb2_grpc.GatewayStub(ch).Generate(
            request(_long_prompt(240), max_tokens=10, ignore_eos=True), timeout=60)
        got: list = []

        def read():
            try:
                got.extend(m for m in call if m.token_ids)
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.CANCELLED

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        assert wait_for(lambda: _engine_state(stack)[0][0] == 1, timeout=10) is not None
        call.cancel()
        reader.join(10)
    assert not got, "the prompt finished before the cancel: the test did not cancel mid-prefill"
    assert wait_for(lambda: all(n == 0 and free == total for n, free, total in _engine_state(stack)),
                    timeout=5) is not None, _engine_state(stack)


def test_shared_prefix_hits_show_in_the_engines_metrics(stacks, expect_greedy):
    """Automatic prefix caching over gRPC: a request sharing a 160-token prefix (10 blocks) with an
    earlier one finds it computed on the verifier and on the drafter; the hits show in each
    engine's specsplit_prefix_cache_tokens_total; the output equals the target alone."""
    from tests.services.procs import scrape

    stack = stacks["split"]

    def hits():
        out = {}
        for role in ("verifier", "drafter"):
            m = scrape(stack[role].metrics_port)
            out[role] = (m[f'specsplit_prefix_cache_tokens_total{{outcome="hit",service="{role}"}}'],
                         m[f'specsplit_prefix_cache_tokens_total{{outcome="queried",service="{role}"}}'])
        return out

    prefix = [3 + (j * 17) % 240 for j in range(160)]
    first, second = prefix + [5, 6, 7, 8], prefix + [9, 10, 11]
    generate(stack.gateway, request(first, max_tokens=8, ignore_eos=True))
    before = hits()
    out = generate(stack.gateway, request(second, max_tokens=8, ignore_eos=True))
    after = hits()
    for role in ("verifier", "drafter"):
        assert after[role][0] - before[role][0] == 160, (role, before, after)
        assert after[role][1] - before[role][1] == len(second)
    expect_greedy(second, out["token_ids"], 8, ignore_eos=True)


@pytest.mark.parametrize("mode", ["split", "colocated"])
def test_server_info_says_which_engines_keep_a_prefix_cache(stacks, mode):
    """GetServerInfo reports each engine's prefix caching (on by default; `specsplit bench` reads
    it to show its split stacks run without, as its colocated arms do: tests/unit/bench)."""
    from tests.services.procs import server_info

    info = server_info(stacks[mode].gateway)
    paged = {s.name: s.kv.prefix_caching for s in info.services if s.kv.paged}
    assert paged == {"verifier": True, "drafter": True}, info.services
