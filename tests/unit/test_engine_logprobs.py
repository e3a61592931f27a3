"""GenerationRequest.logprobs end to end in-process (TargetEngine -> SpecDecoder -> Scheduler ->
Request -> Event): each kept token's log-probability equals log_softmax of the target's fp32
logits at its position (a target-only transformers forward of the same checkpoint, 1e-4), the top
n alternatives are the reference's, greedy tokens do not change, and sampled requests (pending
rejections resolved with the drafter's q rows), preempted requests and abandoned steps keep one
logprob per token."""
from __future__ import annotations

import pytest

from specsplit.request import GenerationRequest
from specsplit.sampling.params import SamplingParams
from specsplit.scheduler import Scheduler
from specsplit.protocols import VerifierTraits
from tests.helpers.colocated import tiny_colocated
from tests.helpers.drafters import LosesRows
from tests.helpers.logprobs import TOL, reference_logprobs

MAX_LEN = 128


def _colo(target, draft, k=3, num_blocks=None, max_num_seqs=8):
    return tiny_colocated(target, draft, MAX_LEN, k=k, num_blocks=num_blocks, max_num_seqs=max_num_seqs)


def _check(model, req, n):
    """One TokenLogprob per output token, equal to the reference; top n = the reference's n best."""
    assert req.logprobs is not None and len(req.logprobs) == len(req.output) > 0
    ref = reference_logprobs(model, req.prompt_token_ids, req.output)
    for j, (t, lp) in enumerate(zip(req.output, req.logprobs)):
        assert lp.token_id == t
        assert abs(lp.logprob - float(ref[j, t])) < TOL, (req.request_id, j)
        assert len(lp.top) == n
        vals = [v for _, v in lp.top]
        assert vals == sorted(vals, reverse=True)
        best = ref[j].topk(n).values.tolist() if n else []
        for (i, v), b in zip(lp.top, best):
            assert abs(v - float(ref[j, i])) < TOL and abs(v - b) < TOL


def _prompt(i: int, n: int) -> tuple[int, ...]:
    return tuple(3 + (i * 37 + j * 11) % 250 for j in range(n))


def _stream(sched, reqs):
    """Run through submit/step, collecting each request's events."""
    events = {r.request_id: [] for r in reqs}
    live = [sched.submit(r, events[r.request_id].append) for r in reqs]
    while sched.has_work:
        sched.step()
    assert all(r.error is None for r in live), [r.error for r in live]
    return live, events


@pytest.fixture(scope="module")
def spec_close(tiny_llama, tiny_draft_close):
    colo = _colo(tiny_llama, tiny_draft_close)
    yield colo
    colo.close()


def test_greedy_tokens_unchanged_and_logprobs_match_the_target(spec_close, hf_target):
    """A batch mixing requests with and without logprobs, cut by max_tokens mid-step (7 is not a
    multiple of k+1): the same tokens as without logprobs, one logprob per kept token."""
    def reqs(lp):
        return [GenerationRequest(f"g{i}", _prompt(i, 5 + 3 * i), 7 + 5 * i, ignore_eos=True,
                                  logprobs=lp[i % len(lp)]) for i in range(6)]

    sched = Scheduler(spec_close.decoder, spec_close.eos_token_ids, max_num_seqs=8)
    off = sched.run(reqs([None]))
    on, events = _stream(Scheduler(spec_close.decoder, spec_close.eos_token_ids, max_num_seqs=8), reqs([5, None, 0, 20]))
    assert [r.output for r in on] == [r.output for r in off]
    assert sum(r.accepted for r in on) > 0  # speculation ran (and was accepted) with logprobs on
    for i, r in enumerate(on):
        n = [5, None, 0, 20][i % 4]
        evs = events[r.request_id]
        if n is None:
            assert r.logprobs is None and all(e.logprobs is None for e in evs)
            continue
        _check(hf_target, r, n)
        assert [lp for e in evs for lp in e.logprobs] == r.logprobs
        assert all(len(e.logprobs) == len(e.token_ids) for e in evs)
    for r in on:  # per-event draft counts add up to usage
        evs = events[r.request_id]
        assert sum(e.proposed for e in evs) == evs[-1].usage["proposed_draft_tokens"] == r.proposed > 0
        assert sum(e.accepted for e in evs) == evs[-1].usage["accepted_draft_tokens"] == r.accepted


def test_eos_cuts_the_logprobs_with_the_tokens(spec_close, hf_target):
    """Stop at the EOS the target emits: find a prompt whose greedy output has one, then stop there."""
    eos = spec_close.eos_token_ids
    sched = Scheduler(spec_close.decoder, (), max_num_seqs=8)
    probes = sched.run([GenerationRequest(f"p{i}", _prompt(i, 6), 60, ignore_eos=True) for i in range(40)])
    hit = next((r for r in probes if any(t in eos for t in r.output)), None)
    if hit is None:
        pytest.skip("the tiny target emits no EOS from these prompts")
    (r,) = Scheduler(spec_close.decoder, eos, 1).run(
        [GenerationRequest("eos", hit.prompt_token_ids, 60, logprobs=2)])
    assert r.finish_reason == "stop" and r.output[-1] in eos
    _check(hf_target, r, 2)


def test_sampled_requests_with_pending_rejections_carry_logprobs(tiny_llama, tiny_draft_far, hf_target):
    """Rejection sampling (coupling=False) with a draft that is often rejected: the recovered
    token of a pending rejection is scored from the rows the verifier kept for resolve."""
    colo = _colo(tiny_llama, tiny_draft_far, k=4)
    try:
        calls = {"resolve": 0}
        resolve = colo.decoder.verifier.resolve

        def counting(rows):
            calls["resolve"] += len(rows)
            return resolve(rows)

        colo.decoder.verifier.resolve = counting
        reqs = [GenerationRequest(f"s{i}", _prompt(i, 8), 24, SamplingParams(1.0, 1.0, 0, seed=10 + i, coupling=False),
                                  ignore_eos=True, logprobs=3) for i in range(4)]
        reqs.append(GenerationRequest("t", _prompt(9, 8), 24, SamplingParams(0.8, 0.9, 20, seed=1, coupling=False),
                                      ignore_eos=True, logprobs=1))
        done, events = _stream(Scheduler(colo.decoder, colo.eos_token_ids, 8), reqs)
        assert calls["resolve"] > 0
        for r in done:
            assert len(r.output) == 24
            _check(hf_target, r, r.request.logprobs)
            assert all(len(e.logprobs) == len(e.token_ids) for e in events[r.request_id])
        assert not any(s.pending_logits is not None for s in colo.target.seqs.values())
    finally:
        colo.close()


def test_preempted_requests_keep_one_logprob_per_token(tiny_llama, tiny_draft_close, hf_target):
    colo = _colo(tiny_llama, tiny_draft_close, num_blocks=12)  # 192 tokens: 5 x 96 do not fit
    try:
        sched = Scheduler(colo.decoder, colo.eos_token_ids, max_num_seqs=8)
        reqs = [GenerationRequest(f"p{i}", _prompt(i, 16), 80, ignore_eos=True, logprobs=2) for i in range(5)]
        done, events = _stream(sched, reqs)
        assert sched.preemptions > 0
        for r in done:
            _check(hf_target, r, 2)
            assert [lp for e in events[r.request_id] for lp in e.logprobs] == r.logprobs
    finally:
        colo.close()


def test_abandoned_steps_drop_their_logprobs(tiny_llama, tiny_draft_far, hf_target):
    colo = _colo(tiny_llama, tiny_draft_far, k=3)
    try:
        lossy = LosesRows(colo.drafter, every=2)
        colo.decoder.drafter = lossy
        colo.decoder.drafter_retry_s = 0.0
        reqs = [GenerationRequest(f"a{i}", _prompt(i, 8), 16, SamplingParams(1.0, 1.0, 0, seed=i, coupling=False),
                                  ignore_eos=True, logprobs=1) for i in range(4)]
        done, events = _stream(Scheduler(colo.decoder, colo.eos_token_ids, 8), reqs)
        assert lossy.failures > 0
        for r in done:
            _check(hf_target, r, 1)
        assert not any(s.pending_logits is not None for s in colo.target.seqs.values())
    finally:
        colo.close()


def test_engine_refuses_more_than_20_alternatives(spec_close):
    from specsplit.engine import EngineError
    from specsplit.protocols import SeqAdd

    with pytest.raises(EngineError, match="logprobs must be in"):
        spec_close.target.add([SeqAdd("x", (1, 2), logprobs=21)])
    assert "x" not in spec_close.target.seqs


class _NoLogprobs(VerifierTraits):
    """A real target engine behind a verifier that drops logprobs (one older than the field)."""

    def __init__(self, engine):
        self.engine = engine
        self.vocab_size = engine.vocab_size

    def add(self, seqs):
        return self.engine.add(seqs)

    def verify(self, reqs):
        from dataclasses import replace

        return [replace(r, logprobs=None) for r in self.engine.verify(reqs)]

    def resolve(self, rows):
        return self.engine.resolve(rows)

    def abandon(self, ids):
        return self.engine.abandon(ids)

    def release(self, ids, finished=False):
        return self.engine.release(ids, finished=finished)


def test_a_verifier_that_sends_no_logprobs_fails_only_the_requests_that_asked(tiny_llama):
    colo = _colo(tiny_llama, None)
    try:
        colo.decoder.verifier = _NoLogprobs(colo.decoder.verifier)
        sched = Scheduler(colo.decoder, colo.eos_token_ids, 8)
        asked = sched.submit(GenerationRequest("a", _prompt(1, 5), 6, ignore_eos=True, logprobs=1))
        plain = sched.submit(GenerationRequest("b", _prompt(2, 5), 6, ignore_eos=True))
        while sched.has_work:
            sched.step()
        assert asked.error is not None and asked.error.kind == "unimplemented" and "logprobs" in asked.error.message
        assert plain.error is None and len(plain.output) == 6
        assert not colo.target.seqs  # the failed one was released
    finally:
        colo.close()
