"""Automatic prefix caching on both engines (kv/block_manager.py; EngineConfig.prefix_caching):
a prompt sharing a prefix with an earlier one reuses its KV blocks, on the verifier and on the
drafter; a preempted request's resume reuses its own; greedy output equals the target alone with
no cache (up to certified near-ties: reused KV was computed in another batch)."""
from __future__ import annotations

import pytest

from specsplit.config import EngineConfig, SpecConfig
from specsplit.factory import build_colocated
from specsplit.request import GenerationRequest
from specsplit.scheduler import KvBudget, Scheduler
from tests.helpers.colocated import greedy_alone
from tests.helpers.greedy import assert_greedy_equal_or_tie
from tests.helpers.prompts import spread_prompt

MAX_LEN = 256


def _colo(target, draft, num_blocks=96, prefix_caching=True, max_len=MAX_LEN):
    cfg = dict(max_model_len=max_len, max_num_seqs=8, max_prefill_tokens=64, num_blocks=num_blocks,
               prefix_caching=prefix_caching)
    return build_colocated(EngineConfig(model=str(target), **cfg),
                           EngineConfig(model=str(draft), **cfg) if draft else None,
                           SpecConfig(num_speculative_tokens=3 if draft else 0, k_policy="fixed"), show_progress=False)


@pytest.fixture(scope="module")
def solo(tiny_llama):
    c = _colo(tiny_llama, None, prefix_caching=False)
    yield greedy_alone(c)
    c.close()


@pytest.mark.parametrize("budget,max_tokens", [(None, 12), (32, 12), (None, 1)])
def test_shared_prefix_is_reused_on_both_engines(tiny_llama, tiny_draft_close, solo, tiny_llama_logits, budget,
                                                  max_tokens):
    """Three requests, one at a time, the 2nd and 3rd sharing the 1st's first 96 tokens (6 blocks):
    each engine finds 96 tokens computed for each of them; with chunked prefill too, and when a
    request ends at its first token (its last piece is registered when it is released). Outputs
    == the target alone, uncached."""
    c = _colo(tiny_llama, tiny_draft_close)
    try:
        system = spread_prompt(1, 96)
        prompts = [system + spread_prompt(2, 30), system + spread_prompt(3, 17), system + spread_prompt(4, 40)]
        sched = Scheduler(c.decoder, c.eos_token_ids, 4, max_num_batched_tokens=budget)
        outs = []
        for i, p in enumerate(prompts):
            (req,) = sched.run([GenerationRequest(f"r{i}", p, max_tokens, ignore_eos=True)])
            outs.append(req.output)
        # max_tokens 1: no drafts (a step may emit only one token), so the drafter never computed a prompt
        engines = (c.target,) if max_tokens == 1 else (c.target, c.drafter)
        for bm in (e.block_manager for e in engines):
            assert bm.prefix_queried_tokens == sum(len(p) for p in prompts)
            assert bm.prefix_hit_tokens == 2 * 96
            assert bm.num_free_blocks == bm.num_blocks  # nothing held; the cached blocks are evictable
        for p, out in zip(prompts, outs):
            assert_greedy_equal_or_tie(solo(p, max_tokens), tiny_llama_logits, out, p)
    finally:
        c.close()


def test_concurrent_requests_share_blocks(tiny_llama, tiny_draft_close):
    """While a request runs, a second one with the same 64-token prefix holds the very same blocks
    (reference counted), not copies; both release everything."""
    c = _colo(tiny_llama, tiny_draft_close)
    try:
        bm = c.target.block_manager
        p = spread_prompt(5, 64)
        sched = Scheduler(c.decoder, c.eos_token_ids, 4)
        a = sched.submit(GenerationRequest("a", p + spread_prompt(6, 10), 30, ignore_eos=True))
        sched.step()
        sched.step()  # a's prompt is final: registered at this step's verify
        b = sched.submit(GenerationRequest("b", p + spread_prompt(7, 5), 30, ignore_eos=True))
        sched.step()
        assert bm.block_table(b.seq_id)[:4] == bm.block_table(a.seq_id)[:4]
        while sched.has_work:
            sched.step()
        assert bm.num_free_blocks == bm.num_blocks and not c.target.seqs
    finally:
        c.close()


def test_preempted_request_resumes_from_its_cached_blocks(tiny_llama, tiny_draft_close, solo, tiny_llama_logits):
    """The scheduler admits against 12 blocks (as if the rest were another gateway's) and preempts
    under that pressure; the engines' larger caches keep the preempted requests' registered blocks,
    so their resumes (prompt + output so far) start from them. Outputs == the target alone."""
    c = _colo(tiny_llama, tiny_draft_close, num_blocks=64, max_len=128)
    try:
        sched = Scheduler(c.decoder, c.eos_token_ids, 8, kv=[KvBudget("verifier", 12, 16), KvBudget("drafter", 12, 16)])
        reqs = sched.run([GenerationRequest(f"p{i}", spread_prompt(i, 16), 80, ignore_eos=True) for i in range(5)])
        assert sched.preemptions > 0
        assert c.target.block_manager.prefix_hit_tokens > 0
        for r in reqs:
            assert_greedy_equal_or_tie(solo(r.prompt_token_ids, 80), tiny_llama_logits, r.output, r.prompt_token_ids)
    finally:
        c.close()
