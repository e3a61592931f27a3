"""Paged KV store: write new tokens' keys and values into their cache slots.

Cache layout: [num_blocks, block_size, num_kv_heads, head_dim]; token t goes to
slot = block_id * block_size + offset, i.e. cache[slot // block_size, slot % block_size].
slot < 0 means "skip" (padding tokens, or positions another step already wrote).

Triton kernel (one program per token, all heads at once), host wrapper and torch reference. Any
strides are accepted for the inputs and the caches (e.g. a layer slice of a bigger cache tensor, or
keys split out of a fused qkv projection), as long as head_dim is contiguous in the caches.
This module imports without triton (the torch reference is the CPU path of specsplit.kernels.dispatch).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # torch-only install (CPU wheel without the `triton` extra)
    triton = None

__all__ = ["store_kv_ref", "store_kv_triton"]


def store_kv_ref(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], written in place
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], written in place
    slot_mapping: torch.Tensor,  # [T] int64, slot < 0 = skip
) -> None:
    _check_shapes(key, value, k_cache, v_cache, slot_mapping)
    block_size = k_cache.shape[1]
    slots = slot_mapping.to(device=k_cache.device, dtype=torch.int64)
    keep = slots >= 0  # [T]
    slots = slots[keep]  # [T']
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = key[keep].to(k_cache.dtype)
    v_cache[blocks, offsets] = value[keep].to(v_cache.dtype)


def store_kv_dense(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], contiguous, written in place
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], contiguous, written in place
    slot_mapping: torch.Tensor,  # [T] int64, every slot >= 0
) -> None:
    """store_kv_ref when every slot is valid: two index_copy_ over the flat slot axis, no mask
    (what the engine sends every step; the layer loop runs it 2 x num_layers times a forward)."""
    h, d = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, h, d).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, h, d).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def _check_shapes(key, value, k_cache, v_cache, slot_mapping) -> None:
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(
            f"key/value must both be [T, Hkv, D], got {tuple(key.shape)} / {tuple(value.shape)}"
        )
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"caches must both be [blocks, block_size, Hkv, D], got {tuple(k_cache.shape)}"
        )
    if k_cache.shape[2:] != key.shape[1:]:
        raise ValueError(
            f"cache heads/dim {tuple(k_cache.shape[2:])} != key {tuple(key.shape[1:])}"
        )
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"slot_mapping must be [{key.shape[0]}], got {tuple(slot_mapping.shape)}")


if triton is not None:

    @triton.jit
    def _store_kv_kernel(
        key_ptr,  # *T [T, Hkv, D]: new keys
        value_ptr,  # *T [T, Hkv, D]: new values
        k_cache_ptr,  # *C [num_blocks, block_size, Hkv, D]: key cache (written)
        v_cache_ptr,  # *C [num_blocks, block_size, Hkv, D]: value cache (written)
        slot_ptr,  # *int64 [T]: destination slot per token, < 0 = skip
        block_size,  # int: tokens per cache block
        num_heads,  # int: Hkv
        head_dim,  # int: D
        stride_kt,  # int: key stride over tokens
        stride_kh,  # int: key stride over heads
        stride_kd,  # int: key stride over head_dim
        stride_vt,  # int: value stride over tokens
        stride_vh,  # int: value stride over heads
        stride_vd,  # int: value stride over head_dim
        stride_kcb,  # int: key cache stride over blocks
        stride_kcs,  # int: key cache stride over block slots
        stride_kch,  # int: key cache stride over heads (head_dim stride is 1)
        stride_vcb,  # int: value cache stride over blocks
        stride_vcs,  # int: value cache stride over block slots
        stride_vch,  # int: value cache stride over heads (head_dim stride is 1)
        BLOCK_H: tl.constexpr,  # power of two >= Hkv
        BLOCK_D: tl.constexpr,  # power of two >= D
    ):
        token = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr + token)
        block = slot // block_size
        offset = slot % block_size
        heads = tl.arange(0, BLOCK_H).to(tl.int64)[:, None]  # [BLOCK_H, 1]
        dims = tl.arange(0, BLOCK_D).to(tl.int64)[None, :]  # [1, BLOCK_D]
        # slot broadcast to the tile before the compare: Triton 3.9's interpreter rejects a mask
        # built from `tensor & scalar_bool` ("mask has unsupported dtype").
        slot_tile = slot + tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.int64)  # [BLOCK_H, BLOCK_D]
        mask = (heads < num_heads) & (dims < head_dim) & (slot_tile >= 0)  # [BLOCK_H, BLOCK_D]

        k = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims * stride_kd, mask=mask)
        v = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims * stride_vd, mask=mask)
        k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs + heads * stride_kch + dims
        v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs + heads * stride_vch + dims
        tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_triton(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], written in place
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], written in place
    slot_mapping: torch.Tensor,  # [T] int64, slot < 0 = skip
) -> None:
    if triton is None:
        raise RuntimeError(
            "store_kv_triton needs triton; install specsplit[triton] or use the torch path"
        )
    _check_shapes(key, value, k_cache, v_cache, slot_mapping)
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("store_kv_triton needs head_dim contiguous in the caches")
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    slots = slot_mapping.to(device=k_cache.device, dtype=torch.int64).contiguous()
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slots,
        k_cache.shape[1],
        num_heads,
        head_dim,
        *key.stride(),
        *value.stride(),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
