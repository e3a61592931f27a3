"""Paged KV store kernel == torch reference (k_cache.view(-1, Hkv, D)[slot] = key)."""

import pytest
import torch

from specsplit.kernels.kv_store import store_kv_ref


@pytest.fixture(scope="module")
def store_triton(load_kernel):
    return load_kernel("kv_store").store_kv_triton


def _slots(num_tokens, num_blocks, block_size, g, skip=0.2):
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    return torch.where(torch.rand(num_tokens, generator=g) < skip, -1, slots)


@pytest.mark.parametrize(
    "tokens,heads,dim,blocks,block_size,dtype",
    [
        (1, 1, 8, 2, 4, torch.float32),
        (13, 3, 24, 7, 5, torch.float32),
        (31, 2, 64, 8, 16, torch.float16),
        (5, 8, 128, 3, 16, torch.float32),
    ],
)
def test_matches_reference(store_triton, device, tokens, heads, dim, blocks, block_size, dtype):
    g = torch.Generator().manual_seed(tokens)
    key = torch.randn(tokens, heads, dim, generator=g)
    value = torch.randn(tokens, heads, dim, generator=g)
    slots = _slots(tokens, blocks, block_size, g)
    caches = [torch.randn(blocks, block_size, heads, dim, generator=g).to(dtype) for _ in range(2)]
    ref_k, ref_v = (c.clone().to(device) for c in caches)
    tri_k, tri_v = (c.clone().to(device) for c in caches)
    key, value, slots = key.to(device), value.to(device), slots.to(device)
    store_kv_ref(key, value, ref_k, ref_v, slots)
    store_triton(key, value, tri_k, tri_v, slots)
    assert torch.equal(tri_k, ref_k) and torch.equal(tri_v, ref_v)
    # the reference is the documented flat-slot assignment
    flat = caches[0].clone().to(device)
    keep = slots >= 0
    flat.view(-1, heads, dim)[slots[keep]] = key[keep].to(dtype)
    assert torch.equal(ref_k, flat)


def test_strided_inputs_and_layer_slice(store_triton, device):
    g = torch.Generator().manual_seed(0)
    tokens, heads, dim, blocks, block_size = 9, 2, 16, 4, 4
    qkv = torch.randn(tokens, 3 * heads, dim, generator=g).to(device)  # fused projection output
    key, value = qkv[:, heads : 2 * heads], qkv[:, 2 * heads :]
    big = torch.zeros(3, 2, blocks, block_size, heads, dim, device=device)  # [layers, k/v, ...]
    ref = big.clone()
    slots = _slots(tokens, blocks, block_size, g, skip=0.0).to(device)
    store_kv_ref(key, value, ref[1, 0], ref[1, 1], slots)
    store_triton(key, value, big[1, 0], big[1, 1], slots)
    assert torch.equal(big, ref)
    assert big[0].abs().sum() == 0 and big[2].abs().sum() == 0


def test_all_skipped_and_empty(store_triton, device):
    cache = torch.zeros(2, 4, 1, 8, device=device)
    key = torch.ones(3, 1, 8, device=device)
    store_triton(key, key, cache, cache.clone(), torch.full((3,), -1, device=device))
    assert cache.abs().sum() == 0
    store_triton(
        key[:0], key[:0], cache, cache.clone(), torch.zeros(0, dtype=torch.long, device=device)
    )


def test_shape_errors_are_clear(store_triton, device):
    cache = torch.zeros(2, 4, 2, 8, device=device)
    with pytest.raises(ValueError, match="heads/dim"):
        store_triton(
            torch.ones(3, 1, 8, device=device),
            torch.ones(3, 1, 8, device=device),
            cache,
            cache,
            torch.zeros(3, dtype=torch.long, device=device),
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_path_equals_reference_when_every_slot_is_valid(dtype):
    """store_kv_dense (the engine's CPU path when no slot is < 0) writes what the reference writes,
    from non-contiguous key/value views as the model passes them."""
    from specsplit.kernels.kv_store import store_kv_dense

    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(11, 4 + 2 + 2, 16, generator=g).to(dtype)
    key, value = qkv[:, 4:6], qkv[:, 6:8]  # [T, Hkv, D] views
    slots = torch.randperm(6 * 4, generator=g)[:11]
    caches = [torch.randn(6, 4, 2, 16, generator=g).to(dtype) for _ in range(2)]
    ref_k, ref_v = (c.clone() for c in caches)
    den_k, den_v = (c.clone() for c in caches)
    store_kv_ref(key, value, ref_k, ref_v, slots)
    store_kv_dense(key, value, den_k, den_v, slots)
    assert torch.equal(den_k, ref_k) and torch.equal(den_v, ref_v)
