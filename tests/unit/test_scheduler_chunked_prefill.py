"""Chunked prefill (Scheduler(max_num_batched_tokens=N)): long prompts are computed in pieces
across steps while running sequences keep decoding, on in-process engines (tests/services covers
the split stack over gRPC).

Every output is compared with the target alone (whole prompts, one request at a time) up to
certified near-ties (tests/helpers/greedy.py): a prompt computed in pieces reduces in another
order than one computed whole.
"""
from __future__ import annotations

import pytest

from specsplit.config import EngineConfig, SpecConfig
from specsplit.factory import build_colocated
from specsplit.request import GenerationRequest
from specsplit.scheduler import Scheduler
from tests.helpers.colocated import greedy_alone
from tests.helpers.greedy import assert_greedy_equal_or_tie
from tests.helpers.prompts import spread_prompt

MAX_LEN = 256


def _colo(target, draft, k=3, async_draft=False):
    cfg = dict(max_model_len=MAX_LEN, max_num_seqs=8, max_prefill_tokens=64, num_blocks=96)
    tc = EngineConfig(model=str(target), **cfg)
    dc = EngineConfig(model=str(draft), **cfg) if draft else None
    spec = SpecConfig(num_speculative_tokens=k if draft else 0, k_policy="fixed", async_draft=async_draft)
    return build_colocated(tc, dc, spec, show_progress=False)


@pytest.fixture(scope="module", params=["lockstep", "async"])
def colo(request, tiny_llama, tiny_draft_close):
    c = _colo(tiny_llama, tiny_draft_close, async_draft=request.param == "async")
    yield c
    c.close()


@pytest.fixture(scope="module")
def solo(tiny_llama):
    """solo(prompt, max_tokens) -> greedy tokens of the target alone, its prompt in one piece."""
    c = _colo(tiny_llama, None)
    yield greedy_alone(c)
    c.close()


def _free(c) -> tuple[int, int]:
    return c.target.block_manager.num_free_blocks, c.drafter.block_manager.num_free_blocks


class Recorder:
    """The real verifier, recording what each step asked of it (tokens it computed per step)."""

    def __init__(self, verifier):
        self.inner = verifier
        self.steps: list[dict[str, tuple[int, int]]] = []  # per verify: seq_id -> (tokens computed, emitted)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def verify(self, reqs):
        before = {r.seq_id: self.inner.seqs[r.seq_id].num_computed for r in reqs}
        lengths = {r.seq_id: len(self.inner.seqs[r.seq_id].tokens) for r in reqs}
        results = self.inner.verify(reqs)
        step = {}
        for r, res in zip(reqs, results):
            s = self.inner.seqs[r.seq_id]
            # tokens the forward computed: the uncached ones it was given, plus the drafts scored
            computed = (s.num_computed - before[r.seq_id] if not res.token_ids
                        else lengths[r.seq_id] - before[r.seq_id] + len(r.draft_token_ids))
            step[r.seq_id] = (computed, len(res.token_ids))
        self.steps.append(step)
        return results


def test_long_prompt_is_prefilled_in_pieces_while_a_stream_decodes(colo, solo, tiny_llama_logits):
    """A 200-token prompt arrives while a stream decodes, budget 48 tokens a step: the stream emits
    at every step; the prompt is computed in pieces of at most the budget, emits nothing until its
    last piece, and both outputs equal the target alone. The drafter computes the same pieces."""
    budget = 48
    recorder = Recorder(colo.decoder.verifier)
    colo.decoder.verifier = recorder
    try:
        sched = Scheduler(colo.decoder, colo.eos_token_ids, 4, max_num_batched_tokens=budget)
        running = sched.submit(GenerationRequest("running", spread_prompt(1, 12), 80, ignore_eos=True))
        for _ in range(3):
            sched.step()
        assert running.output, "the running stream decodes before the long prompt arrives"
        long = sched.submit(GenerationRequest("long", spread_prompt(2, 200), 16, ignore_eos=True))
        sched.step()  # admits it and computes its first piece
        long_id = long.seq_id
        draft_seq = colo.drafter.seqs[long_id]
        first = recorder.steps[-1][long_id][0]
        assert not long.output and 0 < first <= budget
        assert draft_seq.num_computed == first, "the drafter computes the same piece in the same step"
        while sched.has_work:
            sched.step()
    finally:
        colo.decoder.verifier = recorder.inner
    pieces = [s[long_id] for s in recorder.steps if long_id in s]
    first_token = next(i for i, (_, emitted) in enumerate(pieces) if emitted)
    assert first_token >= -(-200 // budget) - 1, pieces  # at least ceil(200 / 48) pieces
    assert all(emitted == 0 and 0 < n <= budget for n, emitted in pieces[:first_token]), pieces
    assert sum(n for n, _ in pieces[:first_token + 1]) >= 200
    # The running stream emitted at every step in which the long prompt was being computed.
    prefill_steps = [s for s in recorder.steps if long_id in s][:first_token + 1]
    assert all(s[running.seq_id][1] > 0 for s in prefill_steps), prefill_steps
    for req in (running, long):
        assert req.finish_reason == "length"
        assert_greedy_equal_or_tie(solo(req.prompt_token_ids, req.request.max_tokens), tiny_llama_logits,
                                   req.output, req.prompt_token_ids)
    assert not colo.decoder.tracks and not colo.target.seqs and not colo.drafter.seqs


def test_several_prompts_share_the_budget_oldest_first(colo, solo, tiny_llama_logits):
    """Four 120-token prompts at once, budget 64: no step computes more than the budget of prompt
    tokens; all four finish equal to the target alone; every block comes back on both engines."""
    before = _free(colo)
    recorder = Recorder(colo.decoder.verifier)
    colo.decoder.verifier = recorder
    try:
        sched = Scheduler(colo.decoder, colo.eos_token_ids, 8, max_num_batched_tokens=64)
        reqs = sched.run([GenerationRequest(f"p{i}", spread_prompt(10 + i, 120), 12, ignore_eos=True) for i in range(4)])
    finally:
        colo.decoder.verifier = recorder.inner
    for step in recorder.steps:
        prompt_tokens = sum(n for n, emitted in step.values() if not emitted)
        assert prompt_tokens <= 64, step
    firsts = [next(i for i, s in enumerate(recorder.steps) if s.get(r.seq_id, (0, 0))[1]) for r in reqs]
    assert firsts == sorted(firsts) and firsts[-1] >= 7  # 480 prompt tokens at <= 64 a step, oldest first
    for r in reqs:
        assert_greedy_equal_or_tie(solo(r.prompt_token_ids, 12), tiny_llama_logits, r.output, r.prompt_token_ids)
    assert _free(colo) == before and not colo.decoder.tracks


def test_cancel_mid_prefill_frees_everything(colo):
    """A request aborted between its pieces: released on both engines, every block back."""
    before = _free(colo)
    sched = Scheduler(colo.decoder, colo.eos_token_ids, 4, max_num_batched_tokens=32)
    req = sched.submit(GenerationRequest("c", spread_prompt(3, 180), 20, ignore_eos=True))
    sched.step()
    sched.step()
    t = colo.decoder.tracks[req.seq_id]
    assert 0 < t.prefill_left < 180 and not req.output  # mid-prefill
    assert colo.target.seqs[req.seq_id].num_computed == 180 - t.prefill_left
    sched.abort(req)
    sched.step()
    assert req.finish_reason == "abort" and not req.output
    assert not sched.has_work and not colo.decoder.tracks and not colo.target.seqs and not colo.drafter.seqs
    assert _free(colo) == before


def test_budget_zero_or_negative_is_refused(colo):
    with pytest.raises(ValueError, match="max_num_batched_tokens must be positive"):
        Scheduler(colo.decoder, colo.eos_token_ids, 4, max_num_batched_tokens=0)


def test_feature_drafter_gets_each_piece_of_features(tiny_llama, solo, tiny_llama_logits, tmp_path_factory):
    """An EAGLE-3 head reads the target's features of each piece with the next piece (one piece
    behind, never the whole prompt at once); the outputs equal the target alone."""
    import torch

    from tests.helpers.eagle3 import write_tiny_head

    head = write_tiny_head(tmp_path_factory.mktemp("tiny-eagle3-chunked"), torch.arange(3, 200))
    c = _colo(tiny_llama, head)
    fd = c.drafter.model if hasattr(c.drafter, "model") else c.drafter
    try:
        sched = Scheduler(c.decoder, c.eos_token_ids, 4, max_num_batched_tokens=40)
        running = sched.submit(GenerationRequest("running", spread_prompt(4, 10), 60, ignore_eos=True))
        sched.step()
        long = sched.submit(GenerationRequest("long", spread_prompt(5, 170), 16, ignore_eos=True))
        committed = []
        while sched.has_work:
            sched.step()
            if long.seq_id in fd.seqs and not long.output:
                committed.append(fd.seqs[long.seq_id].cache.__len__())
        assert committed[0] == 0 and committed[-1] > 0, committed  # features arrived during the prefill
        assert all(b - a <= 40 for a, b in zip(committed, committed[1:])), committed  # a piece at a time
        for req in (running, long):
            assert_greedy_equal_or_tie(solo(req.prompt_token_ids, req.request.max_tokens), tiny_llama_logits,
                                       req.output, req.prompt_token_ids)
        assert running.accepted > 0  # the head really drafted
    finally:
        c.close()
