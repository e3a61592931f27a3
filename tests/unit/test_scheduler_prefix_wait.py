"""Requests that share a prompt's first KV blocks and arrive together (Scheduler._prefix_wait):
with the verifier's prefix caching, the later ones wait until the first has computed those blocks
and then take them from the cache (n choices of one prompt, a shared system prompt); outputs stay
the target's; a request that shares nothing is admitted past them; without prefix caching, or
for a request that scores its prompt, nobody waits."""
from __future__ import annotations

import pytest

from specsplit.request import GenerationRequest
from specsplit.scheduler import Scheduler
from tests.helpers.colocated import greedy_alone, tiny_colocated
from tests.helpers.greedy import assert_greedy_equal_or_tie
from tests.helpers.prompts import spread_prompt

MAX_LEN = 256


@pytest.fixture(scope="module")
def solo(tiny_llama):
    c = tiny_colocated(tiny_llama, None, MAX_LEN, prefix_caching=False)
    yield greedy_alone(c)
    c.close()


@pytest.fixture
def colo(tiny_llama, tiny_draft_close):
    c = tiny_colocated(tiny_llama, tiny_draft_close, MAX_LEN, num_blocks=96)
    yield c
    c.close()


def _run(sched: Scheduler) -> list[set[str]]:
    """Steps to the end; the request ids running after each step."""
    running = []
    while sched.has_work:
        sched.step()
        running.append({r.request.request_id for r in sched.running.values()})
    return running



@pytest.mark.parametrize("budget, max_tokens", [(None, 10), (32, 10), (None, 2)])  # chunked prefill; c0 ends first
def test_choices_of_one_prompt_take_its_blocks_from_the_cache(colo, solo, tiny_llama_logits, budget, max_tokens):
    """Four requests with one 70-token prompt submitted at once: the first computes it, the other
    three wait, then (together) find its 4 full blocks computed (64 tokens each), registered by its
    next step or by its release; every output is the target's."""
    bm = colo.target.block_manager
    prompt = spread_prompt(11, 70)
    sched = Scheduler(colo.decoder, colo.eos_token_ids, 8, max_num_batched_tokens=budget)
    reqs = [sched.submit(GenerationRequest(f"c{i}", prompt, max_tokens, ignore_eos=True)) for i in range(4)]
    running = _run(sched)
    assert running[0] <= {"c0"}  # the others wait for c0's prompt
    assert any(r >= {"c1", "c2", "c3"} for r in running)  # ... and then run together
    assert bm.prefix_queried_tokens == 4 * 70 and bm.prefix_hit_tokens == 3 * 64
    for r in reqs:
        assert_greedy_equal_or_tie(solo(prompt, max_tokens), tiny_llama_logits, r.output, prompt)
    assert bm.num_free_blocks == bm.num_blocks and not colo.target.seqs


def test_a_shared_system_prompt_is_computed_once_and_others_pass_the_waiting(colo, solo, tiny_llama_logits):
    """Two requests share a 96-token system prompt (6 blocks), a third shares nothing: the third is
    admitted with the first, past the second, which waits and then reuses the 6 blocks."""
    bm = colo.target.block_manager
    system = spread_prompt(1, 96)
    prompts = {"a": system + spread_prompt(2, 20), "b": system + spread_prompt(3, 9), "c": spread_prompt(4, 50)}
    sched = Scheduler(colo.decoder, colo.eos_token_ids, 8)
    reqs = {k: sched.submit(GenerationRequest(k, p, 8, ignore_eos=True)) for k, p in prompts.items()}
    running = _run(sched)
    assert running[0] == {"a", "c"}
    assert bm.prefix_hit_tokens == 96
    for k, r in reqs.items():
        assert_greedy_equal_or_tie(solo(prompts[k], 8), tiny_llama_logits, r.output, prompts[k])


def test_nobody_waits_without_prefix_caching(tiny_llama, tiny_draft_close):
    c = tiny_colocated(tiny_llama, tiny_draft_close, MAX_LEN, num_blocks=96, prefix_caching=False)
    try:
        prompt = spread_prompt(12, 70)
        sched = Scheduler(c.decoder, c.eos_token_ids, 8)
        for i in range(3):
            sched.submit(GenerationRequest(f"c{i}", prompt, 4, ignore_eos=True))
        assert _run(sched)[0] == {"c0", "c1", "c2"}
        assert c.target.block_manager.prefix_hit_tokens == 0
    finally:
        c.close()


def test_requests_that_score_their_prompt_never_wait(colo):
    """A request with prompt_logprobs computes its whole prompt (every position's logits) anyway."""
    prompt = spread_prompt(13, 70)
    sched = Scheduler(colo.decoder, colo.eos_token_ids, 8)
    sched.submit(GenerationRequest("a", prompt, 4, ignore_eos=True))
    sched.submit(GenerationRequest("scored", prompt, 3, ignore_eos=True, prompt_logprobs=0))
    assert _run(sched)[0] == {"a", "scored"}


def test_the_one_waited_for_going_away_lets_the_waiting_in(colo):
    """The first request is aborted before its prompt is registered: the second is admitted at
    the next step and computes the prompt itself."""
    prompt = spread_prompt(14, 70)
    sched = Scheduler(colo.decoder, colo.eos_token_ids, 8)
    a = sched.submit(GenerationRequest("a", prompt, 20, ignore_eos=True))
    b = sched.submit(GenerationRequest("b", prompt, 5, ignore_eos=True))
    sched.step()
    assert set(sched.running) == {a.seq_id} and list(sched.waiting) == [b]
    sched.abort(a)
    sched.step()
    assert set(sched.running) == {b.seq_id}
    _run(sched)
    assert len(b.output) == 5 and b.finish_reason == "length"
