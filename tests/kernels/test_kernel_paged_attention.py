"""Paged decode attention kernel (q <= 8 new tokens per sequence) vs torch reference."""

import math

import pytest
import torch

from specsplit.kernels.paged_attention import paged_attention_ref


@pytest.fixture(scope="module")
def attention_triton(load_kernel):
    return load_kernel("paged_attention").paged_attention_triton


def _case(
    batch, num_q, heads, kv_heads, dim, block_size, max_ctx, seed, device, dtype=torch.float32
):
    g = torch.Generator().manual_seed(seed)
    q_lens = torch.randint(1, num_q + 1, (batch,), generator=g)
    context_lens = torch.maximum(torch.randint(1, max_ctx + 1, (batch,), generator=g), q_lens)
    max_blocks = math.ceil(max_ctx / block_size)
    num_blocks = batch * max_blocks + 3
    block_tables = torch.randperm(num_blocks, generator=g)[: batch * max_blocks].reshape(
        batch, max_blocks
    )
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g).to(dtype)
    q = torch.randn(batch, num_q, heads, dim, generator=g).to(dtype)
    return [t.to(device) for t in (q, k_cache, v_cache, block_tables, context_lens, q_lens)]


@pytest.mark.parametrize(
    "batch,num_q,heads,kv_heads,dim,block_size,max_ctx",
    [
        (1, 1, 1, 1, 16, 16, 5),
        (3, 5, 4, 2, 32, 16, 70),
        (5, 8, 6, 2, 24, 4, 37),
        (2, 3, 8, 8, 64, 8, 17),
    ],
)
def test_matches_reference(
    attention_triton, device, batch, num_q, heads, kv_heads, dim, block_size, max_ctx
):
    args = _case(batch, num_q, heads, kv_heads, dim, block_size, max_ctx, seed=batch, device=device)
    expected = paged_attention_ref(*args)
    got = attention_triton(*args)
    q_lens = args[5]
    pad = torch.arange(num_q, device=device)[None, :] >= q_lens[:, None]  # [B, Q]
    assert (got[pad] == 0).all() and (expected[pad] == 0).all()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_half_precision_cache(attention_triton, device):
    args = _case(3, 4, 4, 1, 32, 16, 40, seed=9, device=device, dtype=torch.float16)
    torch.testing.assert_close(
        attention_triton(*args), paged_attention_ref(*args), rtol=2e-3, atol=2e-3
    )


def test_reference_equals_dense_causal_attention(device):
    """One sequence, whole context new: the reference is plain causal SDPA."""
    q, k_cache, v_cache, block_tables, _, _ = _case(1, 6, 4, 2, 16, 4, 6, seed=0, device=device)
    context_lens = torch.tensor([6], device=device)
    q_lens = torch.tensor([6], device=device)
    got = paged_attention_ref(q, k_cache, v_cache, block_tables, context_lens, q_lens)
    pos = torch.arange(6, device=device)
    blocks = block_tables[0][pos // 4]
    keys = k_cache[blocks, pos % 4].repeat_interleave(2, dim=1).transpose(0, 1)  # [Hq, 6, D]
    values = v_cache[blocks, pos % 4].repeat_interleave(2, dim=1).transpose(0, 1)
    dense = torch.nn.functional.scaled_dot_product_attention(
        q[0].transpose(0, 1), keys, values, is_causal=True
    )
    torch.testing.assert_close(got[0], dense.transpose(0, 1), rtol=1e-5, atol=1e-5)
