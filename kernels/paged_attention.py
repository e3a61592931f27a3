"""Paged decode attention for a few new tokens per sequence (decode, or k+1 verify positions).

Each sequence b has q_lens[b] <= Q new query tokens whose keys/values are already in the paged
cache, so it holds context_lens[b] tokens in total and new token i sits at absolute position
context_lens[b] - q_lens[b] + i. Token i attends causally to cache positions <= its own.
Grouped-query attention: query head h reads kv head h // (Hq // Hkv).
Padding query rows (i >= q_lens[b]) come out as zeros.

Triton kernel (one program per (sequence, kv head), all Q * group query rows at once, online
softmax over tiles of KV tokens gathered through the block table), host wrapper, torch reference.
The kernel computes in float32; it matches the reference to float rounding, not bit for bit.
This module imports without triton (the torch reference is the CPU path of specsplit.kernels.dispatch).
"""

from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # torch-only install (CPU wheel without the `triton` extra)
    triton = None

__all__ = ["paged_attention_ref", "paged_attention_triton"]


def paged_attention_ref(
    q: torch.Tensor,  # [B, Q, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int: physical block of each logical block
    context_lens: torch.Tensor,  # [B] int: tokens in the cache, new ones included
    q_lens: torch.Tensor,  # [B] int: valid new tokens (<= Q)
    scale: float | None = None,
) -> torch.Tensor:  # [B, Q, Hq, D] in q's dtype
    batch, num_q, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = torch.zeros(batch, num_q, num_heads, head_dim, dtype=torch.float32, device=q.device)
    for b in range(batch):
        ctx, n_new = int(context_lens[b]), int(q_lens[b])
        if n_new == 0:
            continue
        pos = torch.arange(ctx, device=q.device)  # [ctx]
        blocks = block_tables[b].to(torch.int64)[pos // block_size]  # [ctx]
        keys = (
            k_cache[blocks, pos % block_size].float().repeat_interleave(group, dim=1)
        )  # [ctx, Hq, D]
        values = v_cache[blocks, pos % block_size].float().repeat_interleave(group, dim=1)
        queries = q[b, :n_new].float()  # [n, Hq, D]
        scores = torch.einsum("nhd,chd->hnc", queries, keys) * scale  # [Hq, n, ctx]
        q_pos = ctx - n_new + torch.arange(n_new, device=q.device)  # [n]
        scores = scores.masked_fill(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        out[b, :n_new] = torch.einsum("hnc,chd->nhd", torch.softmax(scores, dim=-1), values)
    return out.to(q.dtype)


if triton is not None:

    @triton.jit
    def _paged_attention_kernel(
        q_ptr,  # *T [B, Q, Hq, D]: queries of the new tokens
        k_cache_ptr,  # *C [num_blocks, block_size, Hkv, D]: key cache
        v_cache_ptr,  # *C [num_blocks, block_size, Hkv, D]: value cache
        block_tables_ptr,  # *int [B, max_blocks]: physical block ids
        context_lens_ptr,  # *int [B]: tokens in the cache per sequence (new ones included)
        q_lens_ptr,  # *int [B]: valid new tokens per sequence
        out_ptr,  # *T [B, Q, Hq, D] out: attention output (zeros on padding rows)
        scale,  # float: softmax scale (1 / sqrt(D) by default)
        num_q,  # int: Q, query slots per sequence
        block_size,  # int: tokens per cache block
        head_dim,  # int: D
        stride_qb,  # int: q stride over sequences
        stride_qi,  # int: q stride over new tokens
        stride_qh,  # int: q stride over heads (head_dim stride is 1)
        stride_kb,  # int: key cache stride over blocks
        stride_ks,  # int: key cache stride over block slots
        stride_kh,  # int: key cache stride over heads (head_dim stride is 1)
        stride_vb,  # int: value cache stride over blocks
        stride_vs,  # int: value cache stride over block slots
        stride_vh,  # int: value cache stride over heads (head_dim stride is 1)
        stride_bt,  # int: row stride of block_tables
        stride_ob,  # int: out stride over sequences
        stride_oi,  # int: out stride over new tokens
        stride_oh,  # int: out stride over heads (head_dim stride is 1)
        GROUP: tl.constexpr,  # Hq // Hkv query heads per kv head
        BLOCK_M: tl.constexpr,  # power of two >= Q * GROUP (query rows of this program)
        BLOCK_N: tl.constexpr,  # KV tokens per tile
        BLOCK_D: tl.constexpr,  # power of two >= D
    ):
        seq = tl.program_id(0).to(tl.int64)
        kv_head = tl.program_id(1).to(tl.int64)
        ctx = tl.load(context_lens_ptr + seq).to(tl.int64)
        n_new = tl.load(q_lens_ptr + seq).to(tl.int64)

        rows = tl.arange(0, BLOCK_M).to(tl.int64)  # [BLOCK_M] row = token * GROUP + head in group
        token = rows // GROUP
        head = kv_head * GROUP + rows % GROUP  # [BLOCK_M] query head
        dims = tl.arange(0, BLOCK_D).to(tl.int64)  # [BLOCK_D]
        row_ok = token < n_new  # [BLOCK_M]
        dim_ok = dims < head_dim
        q_pos = ctx - n_new + token  # [BLOCK_M] absolute position of each query row

        q_ptrs = (
            q_ptr
            + seq * stride_qb
            + token[:, None] * stride_qi
            + head[:, None] * stride_qh
            + dims[None, :]
        )
        q = tl.load(q_ptrs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0).to(
            tl.float32
        )  # [M, D]

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of exp
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)  # running weighted values
        cols = tl.arange(0, BLOCK_N).to(tl.int64)  # [BLOCK_N]
        for start in range(0, ctx, BLOCK_N):
            kv_pos = start + cols  # [BLOCK_N] absolute positions of this tile
            kv_ok = kv_pos < ctx
            block = tl.load(
                block_tables_ptr + seq * stride_bt + kv_pos // block_size, mask=kv_ok, other=0
            )
            block = block.to(tl.int64)
            offset = kv_pos % block_size
            kv_mask = kv_ok[:, None] & dim_ok[None, :]  # [BLOCK_N, BLOCK_D]
            k_ptrs = (
                k_cache_ptr
                + block[:, None] * stride_kb
                + offset[:, None] * stride_ks
                + kv_head * stride_kh
                + dims[None, :]
            )
            v_ptrs = (
                v_cache_ptr
                + block[:, None] * stride_vb
                + offset[:, None] * stride_vs
                + kv_head * stride_vh
                + dims[None, :]
            )
            k = tl.load(k_ptrs, mask=kv_mask, other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_D]
            v = tl.load(v_ptrs, mask=kv_mask, other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_D]

            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [BLOCK_M, BLOCK_N]
            visible = (kv_pos[None, :] <= q_pos[:, None]) & kv_ok[None, :] & row_ok[:, None]
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))  # [BLOCK_M]
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
            p = tl.exp(s - m_safe[:, None])  # [BLOCK_M, BLOCK_N]
            alpha = tl.exp(m_i - m_safe)  # [BLOCK_M]
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            m_i = m_new

        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_ptrs = (
            out_ptr
            + seq * stride_ob
            + token[:, None] * stride_oi
            + head[:, None] * stride_oh
            + dims[None, :]
        )
        tl.store(
            o_ptrs,
            out.to(out_ptr.dtype.element_ty),
            mask=(token < num_q)[:, None] & dim_ok[None, :],
        )


def paged_attention_triton(
    q: torch.Tensor,  # [B, Q, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int
    context_lens: torch.Tensor,  # [B] int
    q_lens: torch.Tensor,  # [B] int
    scale: float | None = None,
) -> torch.Tensor:  # [B, Q, Hq, D] in q's dtype
    if triton is None:
        raise RuntimeError(
            "paged_attention_triton needs triton; install specsplit[triton] or use the torch path"
        )
    batch, num_q, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads {num_heads} not a multiple of kv heads {num_kv_heads}")
    if q.stride(3) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("paged_attention_triton needs head_dim contiguous in q and the caches")
    group = num_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = torch.empty_like(q)
    if batch == 0 or num_q == 0:
        return out
    block_tables = block_tables.contiguous()
    _paged_attention_kernel[(batch, num_kv_heads)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens.contiguous(),
        q_lens.contiguous(),
        out,
        scale,
        num_q,
        block_size,
        head_dim,
        *q.stride()[:3],
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        block_tables.stride(0),
        *out.stride()[:3],
        GROUP=group,
        BLOCK_M=max(16, triton.next_power_of_2(num_q * group)),
        BLOCK_N=16,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
    )
    return out
