"""Tree verification across processes (--tree-nodes): the drafter's tree crosses gRPC in its
Propose reply and the gateway's Verify request; split (3 processes) == colocated == target-only
greedy, token for token (a difference only at a certified near-tie), one stream and 4 at once."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers.greedy import assert_greedy_equal_or_tie
from tests.services.procs import generate, request, scrape, start_colocated, start_split

MAX_TOKENS = 24
TREE = ("--tree-nodes", "2", "--num-speculative-tokens", "3")


@pytest.fixture(scope="module")
def tree_stacks(tmp_path_factory, tiny_llama, tiny_draft_close):
    stacks = {
        "split": start_split(tmp_path_factory.mktemp("tree-split-logs"), tiny_llama, tiny_draft_close,
                             max_num_seqs=4, gateway_extra=TREE),
        "colocated": start_colocated(tmp_path_factory.mktemp("tree-colocated-logs"), tiny_llama, tiny_draft_close,
                                     max_num_seqs=4, extra=TREE),
    }
    try:
        yield {name: s.ready() for name, s in stacks.items()}
    finally:
        for s in stacks.values():
            s.stop()


def _run_all(address, prompts, concurrency):
    reqs = [request(ids, max_tokens=MAX_TOKENS, ignore_eos=True) for ids in prompts]
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda r: generate(address, r), reqs))


@pytest.mark.parametrize("concurrency", [1, 4])
def test_tree_split_equals_colocated_equals_target(tree_stacks, prompts, reference, target_logits, concurrency):
    batch = prompts[:4]
    split = _run_all(tree_stacks["split"].gateway, batch, concurrency)
    colocated = _run_all(tree_stacks["colocated"].gateway, batch, concurrency)
    for ids, s, c in zip(batch, split, colocated):
        expected = reference(ids, MAX_TOKENS, ignore_eos=True)
        assert_greedy_equal_or_tie(expected, target_logits, s["token_ids"], prompt=ids)
        assert_greedy_equal_or_tie(expected, target_logits, c["token_ids"], prompt=ids)
    assert sum(r["usage"]["accepted_draft_tokens"] for r in split) > 0
    assert sum(r["usage"]["accepted_draft_tokens"] for r in colocated) > 0
    # the drafter's trees crossed gRPC twice (Propose reply, Verify request) and were verified as trees
    gw = tree_stacks["split"]["gateway"]
    assert scrape(gw.metrics_port).get("specsplit_draft_tree_nodes_total", 0.0) > 0
