"""GenerationRequest.prompt_logprobs in-process (TargetEngine -> SpecDecoder -> Scheduler -> Request
-> Event): the first event carries one TokenLogprob per prompt token after the first, equal to
log_softmax of the target's fp32 logits at each prompt position (a target-only transformers
forward, 1e-4), with the n most likely alternatives; prompts longer than PROMPT_LOGITS_ROWS are
scored in pieces; the output is the same tokens as without it (greedy, and seeded sampling);
max_tokens 0 scores only; a preempted request is not scored twice; the bounds; nothing stays
allocated."""
from __future__ import annotations

import pytest
import torch

from specsplit.protocols import SeqAdd, VerifyRequest
from specsplit.request import GenerationRequest, RequestError, validate, Limits
from specsplit.sampling.logprobs import PROMPT_LOGITS_ROWS
from specsplit.sampling.params import SamplingParams
from specsplit.scheduler import Scheduler
from tests.helpers.colocated import tiny_colocated
from tests.helpers.logprobs import TOL
from tests.helpers.prompts import spread_prompt

MAX_LEN = 160


def _colo(target, draft, k=3, num_blocks=None, max_num_seqs=8):
    return tiny_colocated(target, draft, MAX_LEN, k=k, num_blocks=num_blocks, max_num_seqs=max_num_seqs)


@pytest.fixture(scope="module")
def spec_close(tiny_llama, tiny_draft_close):
    colo = _colo(tiny_llama, tiny_draft_close)
    yield colo
    colo.close()


def check_prompt_logprobs(model, prompt, lps, n: int) -> None:
    """One TokenLogprob per prompt token after the first, each == the reference's (TOL), with its n
    best alternatives, most likely first."""
    assert lps is not None and len(lps) == len(prompt) - 1
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([list(prompt)])).logits[0].float(), dim=-1)  # [P, V]
    for j, lp in enumerate(lps):
        assert lp.token_id == prompt[j + 1]
        assert abs(lp.logprob - float(ref[j, lp.token_id])) < TOL, j
        assert len(lp.top) == n
        best = ref[j].topk(n).values.tolist() if n else []
        for (t, v), b in zip(lp.top, best):
            assert abs(v - float(ref[j, t])) < TOL and abs(v - b) < TOL


def _stream(sched, reqs):
    events = {r.request_id: [] for r in reqs}
    live = [sched.submit(r, events[r.request_id].append) for r in reqs]
    while sched.has_work:
        sched.step()
    assert all(r.error is None for r in live), [r.error for r in live]
    return live, events


def _free(colo):
    bm = colo.decoder.verifier.block_manager
    return bm.num_free_blocks, (colo.decoder.drafter.block_manager.num_free_blocks if colo.decoder.drafter else None)


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.9, seed=7)], ids=["greedy", "seeded"])
def test_prompt_logprobs_match_the_target_and_leave_the_output_alone(spec_close, hf_target, params):
    """A batch mixing requests with and without prompt_logprobs, prompts of 1 token, short ones and
    ones longer than PROMPT_LOGITS_ROWS (scored in pieces): the first event has the prompt's
    logprobs, later ones none; the tokens equal the same batch without prompt_logprobs."""
    colo = spec_close
    lens = [1, 5, PROMPT_LOGITS_ROWS + 1, 2 * PROMPT_LOGITS_ROWS + 7, 19]
    free = _free(colo)

    def reqs(ask):
        return [GenerationRequest(f"p{i}", spread_prompt(i, n), 12, params, ignore_eos=True,
                                  prompt_logprobs=(i % 3 if ask and i != 4 else None)) for i, n in enumerate(lens)]

    plain, _ = _stream(Scheduler(colo.decoder, colo.eos_token_ids, decode=None), reqs(False))
    live, events = _stream(Scheduler(colo.decoder, colo.eos_token_ids, decode=None), reqs(True))
    assert [r.output for r in live] == [r.output for r in plain]
    for i, r in enumerate(live):
        evs = events[r.request_id]
        if r.request.prompt_logprobs is None:
            assert all(ev.prompt_logprobs is None for ev in evs) and r.prompt_logprobs is None
            continue
        assert evs[0].prompt_logprobs == r.prompt_logprobs and all(ev.prompt_logprobs is None for ev in evs[1:])
        check_prompt_logprobs(hf_target, r.prompt_token_ids, r.prompt_logprobs, i % 3)
    assert sum(r.proposed for r in live) > 0  # speculation ran beside the scoring
    assert _free(colo) == free


def test_max_tokens_0_scores_the_prompt_only(spec_close, hf_target):
    colo = spec_close
    free = _free(colo)
    prompt = spread_prompt(9, 40)
    req = GenerationRequest("score", prompt, 0, prompt_logprobs=2)
    (r,), events = _stream(Scheduler(colo.decoder, colo.eos_token_ids, decode=None), [req])
    assert r.output == [] and r.finish_reason == "length"
    (ev,) = events["score"]
    assert ev.token_ids == [] and ev.finish_reason == "length" and ev.usage["completion_tokens"] == 0
    check_prompt_logprobs(hf_target, prompt, ev.prompt_logprobs, 2)
    assert _free(colo) == free


def test_a_preempted_request_is_scored_once(tiny_llama, tiny_draft_close, hf_target):
    """A KV cache that holds ~2 requests: 5 asking for prompt logprobs finish (with preemptions),
    each with its prompt scored once and the same tokens as alone."""
    colo = _colo(tiny_llama, tiny_draft_close, num_blocks=14)
    try:
        reqs = [GenerationRequest(f"q{i}", spread_prompt(i, 30), 40, ignore_eos=True, prompt_logprobs=1) for i in range(5)]
        sched = Scheduler(colo.decoder, colo.eos_token_ids, decode=None)
        live, events = _stream(sched, reqs)
        assert sched.preemptions > 0
        for r in live:
            assert sum(ev.prompt_logprobs is not None for ev in events[r.request_id]) == 1
            check_prompt_logprobs(hf_target, r.prompt_token_ids, r.prompt_logprobs, 1)
            (alone,) = Scheduler(colo.decoder, colo.eos_token_ids, decode=None).run(
                [GenerationRequest("a", r.prompt_token_ids, 40, ignore_eos=True)])
            assert r.output == alone.output
    finally:
        colo.close()


def test_the_engine_scores_at_the_first_verify_only(spec_close):
    """TargetEngine: the first verify's result carries the prompt's logprobs, the next none; a
    verify that was abandoned keeps the prompt's KV valid (the next verify's tokens are the same)."""
    eng = spec_close.decoder.verifier
    prompt = spread_prompt(3, PROMPT_LOGITS_ROWS + 5)
    eng.add([SeqAdd("a", prompt, prompt_logprobs=0), SeqAdd("b", prompt)])
    try:
        first = eng.verify([VerifyRequest("a"), VerifyRequest("b")])
        assert len(first[0].prompt_logprobs) == len(prompt) - 1 and first[1].prompt_logprobs is None
        assert first[0].token_ids == first[1].token_ids
        eng.abandon(["a"])
        again = eng.verify([VerifyRequest("a"), VerifyRequest("b")])
        assert again[0].prompt_logprobs is None and again[0].token_ids == first[1].token_ids
    finally:
        eng.release(["a", "b"])


def test_bounds():
    limits = Limits(vocab_size=256, max_model_len=16)
    ok = GenerationRequest("x", (5, 6, 7), 0, prompt_logprobs=20)
    validate(ok, limits)
    for bad, words in [(GenerationRequest("x", (5, 6), 1, prompt_logprobs=21), "prompt_logprobs must be in [0, 20]"),
                       (GenerationRequest("x", (5, 6), 1, prompt_logprobs=-1), "prompt_logprobs must be in [0, 20]"),
                       (GenerationRequest("x", (5, 6), 0), "max_tokens must be >= 1"),
                       (GenerationRequest("x", tuple(range(3, 19)), 0, prompt_logprobs=0), "exceeds max_model_len")]:
        with pytest.raises(RequestError, match=None) as e:
            validate(bad, limits)
        assert e.value.kind == RequestError.INVALID and words in e.value.message, e.value.message
