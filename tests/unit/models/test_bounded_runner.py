"""BoundedRunner keeps every forward inside the shape the profile measured, with the same results."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specsplit.config import EngineConfig
from specsplit.engine_build import load_for
from specsplit.kv.block_manager import OutOfBlocks
from specsplit.models.bounded_runner import BoundedRunner, ForwardBound, split_forward
from specsplit.models.runner import ForwardItem, ModelRunner

items_st = st.lists(
    st.tuples(st.integers(0, 40), st.integers(1, 90), st.integers(1, 5)),  # start, new tokens, logits
    min_size=1, max_size=12,
)


@settings(max_examples=200, deadline=None)
@given(items_st, st.integers(1, 6), st.integers(1, 6), st.integers(1, 64))
def test_split_forward_respects_the_bound_and_keeps_every_token(raw, n, window, prefill):
    bound = ForwardBound(max_num_seqs=n, window=window, max_prefill_tokens=prefill)
    items = [ForwardItem(f"s{i}", start, list(range(q)), min(logits, q)) for i, (start, q, logits) in enumerate(raw)]
    groups = split_forward(items, bound)
    seen = {i: [] for i in range(len(items))}
    for g in groups:
        assert 0 < len(g) <= n
        assert len({p.index for p in g}) == len(g)  # a sequence appears once per forward
        long = [len(p.item.token_ids) for p in g if len(p.item.token_ids) > window]
        assert sum(long) <= prefill or (len(g) == 1 and len(long) == 1)
        for p in g:
            seen[p.index].append(p)
    for i, it in enumerate(items):
        pieces = seen[i]
        assert [t for p in pieces for t in p.item.token_ids] == list(it.token_ids)
        starts = [p.item.start for p in pieces]
        assert starts[0] == it.start and all(b > a for a, b in zip(starts, starts[1:]))
        assert [p.final for p in pieces] == [False] * (len(pieces) - 1) + [True]
        assert pieces[-1].item.num_logits == it.num_logits


@pytest.fixture(scope="module")
def model(tiny_llama):
    return load_for(EngineConfig(model=str(tiny_llama), max_model_len=128), False).model


def test_bounded_runner_matches_one_big_forward(model):
    bound = ForwardBound(max_num_seqs=2, window=4, max_prefill_tokens=16)
    plain = ModelRunner(model, 64, 16, 128)
    bounded = BoundedRunner(model, 64, 16, 128, bound)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (40, 3, 25, 4, 60)]
    items = [ForwardItem(f"s{i}", 0, p, 2 if len(p) > 1 else 1) for i, p in enumerate(prompts)]
    ref = plain.forward(items)
    out = bounded.forward(items)
    for a, b in zip(ref, out):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    # then a verification step on every sequence, which fits in one forward of N=2 ... split by seqs
    step = [ForwardItem(f"s{i}", len(p), [1, 2, 3], 3) for i, p in enumerate(prompts)]
    for a, b in zip(plain.forward(step), bounded.forward(step)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert plain.block_manager.num_free_blocks == bounded.block_manager.num_free_blocks


def test_bounded_runner_out_of_blocks_changes_nothing(model):
    bounded = BoundedRunner(model, 4, 16, 128, ForwardBound(max_num_seqs=1, window=4, max_prefill_tokens=8))
    bounded.forward([ForwardItem("a", 0, list(range(20)), 1)])  # 2 blocks
    free = bounded.block_manager.num_free_blocks
    with pytest.raises(OutOfBlocks):
        bounded.forward([ForwardItem("b", 0, list(range(20)), 1), ForwardItem("c", 0, list(range(20)), 1)])
    assert bounded.block_manager.num_free_blocks == free
    assert not bounded.block_manager.has("b") and not bounded.block_manager.has("c")
    assert bounded.block_manager.length("a") == 20
