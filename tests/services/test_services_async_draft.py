"""Pre-drafting in the split stack (on by default there): the gateway says so, counts the branches
it pre-drafted (ServerInfo and Prometheus), and greedy streams equal target-only, many at once."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from tests.services.procs import generate, request, scrape, server_info


def test_split_gateway_pre_drafts_and_counts_branches(split_stack, colocated_stack, prompts, expect_greedy):
    info = server_info(split_stack.gateway)
    assert info.async_draft and not server_info(colocated_stack.gateway).async_draft  # one process: off by default
    before = info.branch_hits + info.branch_misses
    out = generate(split_stack.gateway, request(prompts[4], max_tokens=32, ignore_eos=True))
    expect_greedy(prompts[4], out["token_ids"], 32, ignore_eos=True)
    after = server_info(split_stack.gateway)
    assert after.branch_hits + after.branch_misses > before
    gw = scrape(split_stack["gateway"].metrics_port)
    assert gw['specsplit_branches_total{outcome="hit"}'] + gw['specsplit_branches_total{outcome="miss"}'] > 0
    assert gw["specsplit_draft_wait_seconds_count"] > 0
    # the K choices of its steps: some asked for drafts (the branches above came from them)
    steps = {key: v for key, v in gw.items() if key.startswith("specsplit_steps_total{")}
    assert sum(v for key, v in steps.items() if key != 'specsplit_steps_total{k="0"}') > 0, steps


def test_split_async_many_streams_equal_target_only(split_stack, prompts, expect_greedy):
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda p: generate(split_stack.gateway, request(p, max_tokens=20, ignore_eos=True)),
                             prompts[:8]))
    for p, out in zip(prompts[:8], outs):
        expect_greedy(p, out["token_ids"], 20, ignore_eos=True)
