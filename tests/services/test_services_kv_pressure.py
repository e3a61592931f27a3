"""KV-aware admission and preemption through the public API (real processes on loopback): the
measured failure of issue 14 -- `serve --max-model-len 512 --num-blocks 64`, 5 concurrent requests
of 252 prompt + 244 new tokens (a 1,024-token cache), 0/5 finished, all RESOURCE_EXHAUSTED -- now
finishes 5/5 with each stream's greedy tokens equal to a solo target-only run, colocated and split,
the preemptions counted in the metrics, and every KV block back on both engines afterwards.
"""
from __future__ import annotations

import random
import threading

import grpc
import pytest

from tests.services.procs import (
    SPECULATE_ALWAYS, ServiceProcess, Stack, free_port, generate, request, scrape, server_info, start_split,
    wait_for,
)

CACHE = ["--max-model-len", "512", "--num-blocks", "64", "--max-prefill-tokens", "128", "--threads", "1"]
PROMPT, NEW = 252, 244


def _colocated(log_dir, target, draft) -> Stack:
    port = free_port()
    argv = ["serve", "--target", str(target), "--draft", str(draft), "--port", str(port), "--max-num-seqs", "8",
            *CACHE, *SPECULATE_ALWAYS]
    return Stack({"gateway": ServiceProcess("colocated", argv, log_dir, port, free_port())})


def _split(log_dir, target, draft) -> Stack:
    stack = start_split(log_dir, target, draft, max_num_seqs=8, service_extra=tuple(CACHE),
                        gateway_extra=("--verifier-timeout", "120"))
    return stack


@pytest.fixture(scope="module")
def stacks(tmp_path_factory, tiny_llama, tiny_draft_close):
    s = {"colocated": _colocated(tmp_path_factory.mktemp("kvp-colo"), tiny_llama, tiny_draft_close),
         "split": _split(tmp_path_factory.mktemp("kvp-split"), tiny_llama, tiny_draft_close)}
    try:
        yield s
    finally:
        for stack in s.values():
            stack.stop()


@pytest.fixture(scope="module")
def solo(tiny_llama):
    """Greedy tokens of the target alone, one request at a time, with room for 512 tokens."""
    from tests.helpers.colocated import greedy_alone, tiny_colocated

    colo = tiny_colocated(tiny_llama, None, 512, max_num_seqs=1, max_prefill_tokens=128, num_blocks=64)
    run = greedy_alone(colo)
    yield lambda ids: run(ids, NEW)
    colo.close()


@pytest.mark.parametrize("mode", ["colocated", "split"])
def test_kv_pressure_finishes_every_stream(stacks, solo, mode):
    stack = stacks[mode].ready()
    rng = random.Random(14)
    prompts = [[rng.randrange(3, 256) for _ in range(PROMPT)] for _ in range(5)]
    results: dict[int, object] = {}

    def run(i):
        try:
            results[i] = generate(stack.gateway, request(prompts[i], max_tokens=NEW, ignore_eos=True), timeout=300)
        except grpc.RpcError as e:
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(400)
    errors = {i: r for i, r in results.items() if isinstance(r, grpc.RpcError)}
    assert not errors, {i: (e.code(), e.details()) for i, e in errors.items()}
    for i in range(5):
        assert results[i]["finish_reason"] == "length"
        assert results[i]["token_ids"] == solo(prompts[i]), f"stream {i} differs from its solo run"
    assert scrape(stack["gateway"].metrics_port).get("specsplit_preemptions_total", 0) > 0
    assert "preempted request" in stack["gateway"].log_path.read_text()

    def all_blocks_back():
        info = server_info(stack.gateway)
        return info.num_running == 0 and all(
            s.kv.free_blocks == s.kv.num_blocks and s.num_running == 0 for s in info.services if s.kv.paged)

    assert wait_for(all_blocks_back, timeout=20, poll=0.2) is not None

