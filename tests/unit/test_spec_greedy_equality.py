"""Speculative greedy output == target-only greedy output, token for token (fp32, tiny pairs).

Speculation verifies K+1 tokens per sequence where target-only runs 1, so the two reduce in a
different order; a difference is accepted only at a certified near-tie of the target
(tests/helpers/greedy.py), never otherwise."""
from __future__ import annotations

import pytest
import torch

from specsplit.config import EngineConfig, SpecConfig
from specsplit.factory import build_colocated
from specsplit.request import GenerationRequest
from specsplit.scheduler import Scheduler
from tests.helpers.greedy import assert_greedy_equal_or_tie

MAX_LEN = 160


def _requests(n: int, seed: int = 0, max_tokens: int = 24) -> list[GenerationRequest]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(1, 40, (1,), generator=g))
        # Repetitive prompts give the n-gram proposer something to find.
        base = torch.randint(3, 256, (max(1, length // 2),), generator=g).tolist()
        prompt = (base * 3)[:length]
        out.append(GenerationRequest(f"r{i}", tuple(prompt), max_tokens, ignore_eos=True))
    return out


def _run(target, draft, k, requests, max_num_seqs=16):
    tc = EngineConfig(model=str(target), max_model_len=MAX_LEN, max_num_seqs=max_num_seqs)
    dc = None if draft is None else EngineConfig(model=str(draft), max_model_len=MAX_LEN, max_num_seqs=max_num_seqs)
    colo = build_colocated(tc, dc, SpecConfig(num_speculative_tokens=k), show_progress=False)
    gen = Scheduler(colo.decoder, colo.eos_token_ids, max_num_seqs)
    states = gen.run(requests)
    free = colo.target.block_manager.num_free_blocks, colo.target.block_manager.num_blocks
    assert free[0] == free[1], "target KV blocks leaked"
    if colo.draft_model is not None:
        bm = colo.drafter.block_manager
        assert bm.num_free_blocks == bm.num_blocks, "draft KV blocks leaked"
    return [s.output for s in states], sum(s.proposed for s in states), sum(s.accepted for s in states)


@pytest.fixture(scope="module")
def target_logits(tiny_llama_logits):
    return tiny_llama_logits


def _assert_equal(out, ref, batch, target_logits):
    for req, o, r in zip(_requests(batch, seed=batch), out, ref):
        assert_greedy_equal_or_tie(r, target_logits, o, prompt=req.prompt_token_ids)
    assert len(out) == len(ref)


@pytest.fixture(scope="module")
def reference(tiny_llama):
    cache = {}

    def get(batch):
        if batch not in cache:
            cache[batch] = _run(tiny_llama, None, 0, _requests(batch, seed=batch))[0]
        return cache[batch]

    return get


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("batch", [1, 4, 16])
def test_close_draft_greedy_equal(tiny_llama, tiny_draft_close, reference, target_logits, k, batch):
    out, proposed, accepted = _run(tiny_llama, tiny_draft_close, k, _requests(batch, seed=batch))
    _assert_equal(out, reference(batch), batch, target_logits)
    assert proposed > 0 and accepted / proposed > 0.3, "the close draft should agree often"


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("batch", [1, 16])
def test_far_draft_greedy_equal(tiny_llama, tiny_draft_far, reference, target_logits, k, batch):
    out, proposed, accepted = _run(tiny_llama, tiny_draft_far, k, _requests(batch, seed=batch))
    _assert_equal(out, reference(batch), batch, target_logits)
    assert proposed > 0


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("batch", [1, 4, 16])
def test_ngram_greedy_equal(tiny_llama, reference, target_logits, k, batch):
    out, proposed, _ = _run(tiny_llama, "ngram", k, _requests(batch, seed=batch))
    _assert_equal(out, reference(batch), batch, target_logits)


def test_target_as_its_own_draft_accepts_everything(tiny_llama, reference, target_logits):
    out, proposed, accepted = _run(tiny_llama, tiny_llama, 4, _requests(4, seed=4))
    _assert_equal(out, reference(4), 4, target_logits)
    assert proposed > 0 and accepted == proposed
