"""min_tokens stays lossless under speculation (greedy, fp32, tiny pairs): the stop ids it holds back
are the ones the target-only output would have taken early, so the held-back output differs from the
unheld one, and speculative output == target-only output with the same min_tokens, token for token
(or a certified near-tie of the target with those ids held back)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from specsplit.config import EngineConfig, SpecConfig
from specsplit.factory import build_colocated
from specsplit.request import GenerationRequest, with_min_tokens_stops
from specsplit.sampling.params import SamplingParams
from specsplit.scheduler import Scheduler
from tests.helpers.greedy import assert_greedy_equal_or_tie
from tests.helpers.structured import constrained_next_logits

MAX_LEN, MAX_TOKENS, MIN_TOKENS = 128, 16, 10


def _colocated(target, draft, k):
    """draft: None (target-only), "ngram" or a model directory."""
    tc = EngineConfig(model=str(target), max_model_len=MAX_LEN, max_num_seqs=8)
    dc = None if draft is None else EngineConfig(model=str(draft), max_model_len=MAX_LEN, max_num_seqs=8)
    return build_colocated(tc, dc, SpecConfig(num_speculative_tokens=k), show_progress=False)


def _prompts(n: int = 4) -> list[tuple[int, ...]]:
    g = torch.Generator().manual_seed(5)
    return [tuple((torch.randint(3, 256, (4 + i,), generator=g).tolist() * 3)[: 6 + 3 * i]) for i in range(n)]


@pytest.fixture(scope="module")
def held(tiny_llama):
    """Per prompt a request whose stop ids are tokens of its unheld output's first positions, and
    the target-only output with min_tokens holding them back."""
    colo = _colocated(tiny_llama, None, 0)
    try:
        sched = Scheduler(colo.decoder, colo.eos_token_ids, 8)
        free = [s.output for s in sched.run([GenerationRequest(f"f{i}", p, MAX_TOKENS, ignore_eos=True)
                                             for i, p in enumerate(_prompts())])]
        reqs = [GenerationRequest(f"m{i}", p, MAX_TOKENS, SamplingParams(min_tokens=MIN_TOKENS),
                                  stop_token_ids=(o[1], o[4])) for i, (p, o) in enumerate(zip(_prompts(), free))]
        ref = [s.output for s in sched.run(reqs)]
        eos = tuple(colo.eos_token_ids)
    finally:
        colo.close()
    return free, reqs, ref, eos


def test_the_held_back_output_is_not_the_free_one(held):
    free, reqs, ref, _ = held
    for f, r, req in zip(free, ref, reqs):
        assert r[1] != f[1]  # f[1] is a stop id: held back at position 1
        assert not set(r[:MIN_TOKENS]) & set(req.stop_token_ids)
        assert len(r) > MIN_TOKENS  # nothing ended it before min_tokens + 1 tokens
        stops = [j for j, t in enumerate(r) if t in req.stop_token_ids]
        assert stops == [] or stops == [len(r) - 1]  # from there on a stop id ends it, kept


@pytest.mark.parametrize("draft, k", [("close", 4), ("ngram", 3)])
def test_speculative_equals_target_only(tiny_llama, tiny_draft_close, tiny_llama_logits, held, draft, k):
    _, reqs, ref, eos = held
    colo = _colocated(tiny_llama, tiny_draft_close if draft == "close" else "ngram", k)
    try:
        states = Scheduler(colo.decoder, colo.eos_token_ids, 8).run([replace(r, request_id=f"s{r.request_id}") for r in reqs])
        bm = colo.target.block_manager
        assert bm.num_free_blocks == bm.num_blocks, "target KV blocks leaked"
    finally:
        colo.close()
    assert sum(s.proposed for s in states) > 0, "the drafter never proposed: nothing was tested"
    for req, s, r in zip(reqs, states, ref):
        params = with_min_tokens_stops(req, eos).params  # what the engines were given
        f = constrained_next_logits(tiny_llama_logits, params, len(req.prompt_token_ids), None)
        assert_greedy_equal_or_tie(r, f, s.output, prompt=req.prompt_token_ids)
