"""Random rejection sampling: two Triton kernels, their host wrappers, torch references.

  accept: one program per sequence; accept draft j while u_j * q(x_j) < p(x_j) (float64), stop at
          the first rejection. Reads only K probabilities of target_probs per sequence.
  finish: one program per sequence; samples the recovered token from normalize(max(0, p - q)), or
          from p when the residual has no mass (q = zeros means "bonus"), by the exact integer
          inverse CDF of reference.py. Tiled over the vocabulary in two passes (totals
          and argmax, then the CDF search), so no [B, V] temporary is materialised.

The uniforms are inputs (drawn per sequence on the host by specsplit.sampling.rng), so the outputs
equal the torch references exactly:
reference.random_accept_ref / random_finish_ref (beside it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specsplit.kernels.reference import random_accept_ref, random_finish_ref
from specsplit.kernels.reference import WEIGHT_SCALE

__all__ = ["random_accept_triton", "random_finish_triton", "random_accept_ref", "random_finish_ref"]

FLOAT32_MAX = 3.4028234663852886e38
FINISH_BLOCK_V = 2048  # vocabulary tile on a GPU
INTERPRETER_BLOCK_V = 16384  # larger tiles amortise the per-op cost of TRITON_INTERPRET=1


@triton.jit
def _random_accept_kernel(
    draft_ids_ptr,  # *int64 [B, K]: drafted token ids
    draft_q_ptr,  # *float32 [B, K]: q(x_j) of each drafted id
    num_draft_ptr,  # *int64 [B]: drafts per sequence (clamped to [0, K])
    target_probs_ptr,  # *float32 [B, K+1, V]: target distribution p at each scored position
    u_ptr,  # *float64 [B, K]: accept uniforms in [0, 1)
    num_accepted_ptr,  # *int64 [B] out: accepted drafts per sequence
    K,  # int: max drafts per sequence
    V,  # int: vocabulary size
    stride_draft,  # int: row stride of draft_ids
    stride_q,  # int: row stride of draft_q
    stride_u,  # int: row stride of u
    stride_pb,  # int: target_probs stride over sequences
    stride_pk,  # int: target_probs stride over positions (vocab stride must be 1)
    BLOCK_K: tl.constexpr,  # power of two >= K
):
    row = tl.program_id(0).to(tl.int64)
    pos = tl.arange(0, BLOCK_K).to(tl.int64)  # [BLOCK_K]
    num_draft = tl.load(num_draft_ptr + row)
    num_draft = tl.minimum(tl.maximum(num_draft, 0), K)
    live = pos < num_draft  # [BLOCK_K]

    ids = tl.load(draft_ids_ptr + row * stride_draft + pos, mask=live, other=-1)
    valid = live & (ids >= 0) & (ids < V)  # out-of-range ids read p = 0 and are rejected
    p = tl.load(target_probs_ptr + row * stride_pb + pos * stride_pk + ids, mask=valid, other=0.0)
    q = tl.load(draft_q_ptr + row * stride_q + pos, mask=live, other=0.0)
    u = tl.load(u_ptr + row * stride_u + pos, mask=live, other=1.0)

    accepted = u * q.to(tl.float64) < p.to(tl.float64)  # [BLOCK_K], u < p/q without division
    stop = (~accepted) & live
    first_stop = tl.min(tl.where(stop, pos, K), axis=0)
    tl.store(num_accepted_ptr + row, tl.minimum(first_stop, num_draft))


@triton.jit
def _weights(x, WEIGHT_SCALE: tl.constexpr):
    """floor(clamp(nan_to_num(x), 0, 1) * 2**44) as int64; same as sample.integer_weights."""
    x = tl.where(x == x, x, 0.0)
    x = tl.minimum(tl.maximum(x, 0.0), 1.0)
    return tl.floor(x * WEIGHT_SCALE).to(tl.int64)


@triton.jit
def _random_finish_kernel(
    p_ptr,  # *float32 [B, V]: target distribution at each sequence's stop position
    q_ptr,  # *float32 [B, V]: draft distribution there; zeros = bonus (sample from p)
    u_ptr,  # *float64 [B]: final uniform per sequence in [0, 1)
    out_ptr,  # *int64 [B] out: sampled token id in [0, V)
    V,  # int: vocabulary size
    stride_p,  # int: row stride of p (vocab stride must be 1)
    stride_q,  # int: row stride of q (vocab stride must be 1)
    WEIGHT_SCALE: tl.constexpr,  # 2**44, the integer CDF resolution
    FLOAT32_MAX: tl.constexpr,  # largest finite float32 (nan_to_num bound for the argmax)
    BLOCK_V: tl.constexpr,  # vocabulary tile
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_V).to(tl.int64)  # [BLOCK_V]
    p_row = p_ptr + row * stride_p
    q_row = q_ptr + row * stride_q

    # pass 1: integer totals of the residual and of p, and argmax(p) for the zero-mass fallback
    total_r = tl.zeros([], dtype=tl.int64)
    total_p = tl.zeros([], dtype=tl.int64)
    best_val = tl.full([], float("-inf"), dtype=tl.float32)
    best_idx = tl.zeros([], dtype=tl.int64)
    for start in range(0, V, BLOCK_V):
        idx = start + offs
        mask = idx < V
        p = tl.load(p_row + idx, mask=mask, other=0.0)
        q = tl.load(q_row + idx, mask=mask, other=0.0)
        total_r += tl.sum(_weights(p - q, WEIGHT_SCALE), axis=0)
        total_p += tl.sum(_weights(p, WEIGHT_SCALE), axis=0)
        p_am = tl.where(p == p, p, 0.0)
        p_am = tl.minimum(tl.maximum(p_am, -FLOAT32_MAX), FLOAT32_MAX)
        p_am = tl.where(mask, p_am, float("-inf"))
        tile_val, tile_arg = tl.max(p_am, axis=0, return_indices=True)
        better = tile_val > best_val  # strict: the first maximum wins, like torch.argmax
        best_idx = tl.where(better, start + tile_arg.to(tl.int64), best_idx)
        best_val = tl.where(better, tile_val, best_val)

    use_residual = total_r > 0
    total = tl.where(use_residual, total_r, total_p)
    u = tl.load(u_ptr + row)
    threshold = tl.floor(u * total.to(tl.float64)).to(tl.int64)
    threshold = tl.minimum(threshold, total - 1)

    # pass 2: token = number of CDF entries <= threshold (= first index with cdf > threshold)
    carry = tl.zeros([], dtype=tl.int64)
    count = tl.zeros([], dtype=tl.int64)
    for start in range(0, V, BLOCK_V):
        idx = start + offs
        mask = idx < V
        p = tl.load(p_row + idx, mask=mask, other=0.0)
        q = tl.load(q_row + idx, mask=mask, other=0.0)
        w = tl.where(use_residual, _weights(p - q, WEIGHT_SCALE), _weights(p, WEIGHT_SCALE))
        cdf = carry + tl.cumsum(w, axis=0)  # [BLOCK_V] int64
        count += tl.sum(((cdf <= threshold) & mask).to(tl.int64), axis=0)
        carry += tl.sum(w, axis=0)

    token = tl.minimum(count, V - 1)
    token = tl.where(total > 0, token, best_idx)
    tl.store(out_ptr + row, token)


def random_accept_triton(
    draft_ids: torch.Tensor,  # [B, K] int64
    draft_q: torch.Tensor,  # [B, K] float32
    num_draft: torch.Tensor,  # [B] int64
    target_probs: torch.Tensor,  # [B, K+1, V] float32
    u_accept: torch.Tensor,  # [B, K] float64
) -> torch.Tensor:  # num_accepted [B] int64
    batch, k = draft_ids.shape
    device = target_probs.device
    num_draft = num_draft.to(device=device, dtype=torch.int64).contiguous()
    if k == 0 or batch == 0:
        return num_draft.clamp(0, k)
    if target_probs.dim() != 3 or target_probs.shape[0] != batch or target_probs.shape[1] < k:
        raise ValueError(
            f"target_probs must be [{batch}, {k + 1}, V], got {tuple(target_probs.shape)}"
        )
    draft_ids = draft_ids.to(device=device, dtype=torch.int64).contiguous()
    draft_q = draft_q.to(device=device, dtype=torch.float32).contiguous()
    u_accept = u_accept.to(device=device, dtype=torch.float64).contiguous()
    target_probs = target_probs.float()
    if target_probs.stride(2) != 1:
        target_probs = target_probs.contiguous()
    num_accepted = torch.empty(batch, dtype=torch.int64, device=device)
    _random_accept_kernel[(batch,)](
        draft_ids,
        draft_q,
        num_draft,
        target_probs,
        u_accept,
        num_accepted,
        k,
        target_probs.shape[2],
        draft_ids.stride(0),
        draft_q.stride(0),
        u_accept.stride(0),
        target_probs.stride(0),
        target_probs.stride(1),
        BLOCK_K=triton.next_power_of_2(k),
    )
    return num_accepted


def random_finish_triton(
    target_probs_row: torch.Tensor,  # [B, V] float32
    draft_q_row: torch.Tensor,  # [B, V] float32, zeros where all drafts were accepted
    u_final: torch.Tensor,  # [B] float64
    block_v: int | None = None,  # vocabulary tile; None = a default for the device
) -> torch.Tensor:  # ids [B] int64
    batch, vocab = target_probs_row.shape
    if block_v is None:
        block_v = INTERPRETER_BLOCK_V if target_probs_row.device.type == "cpu" else FINISH_BLOCK_V
    device = target_probs_row.device
    if draft_q_row.shape != (batch, vocab):
        raise ValueError(f"draft_q_row must be [{batch}, {vocab}], got {tuple(draft_q_row.shape)}")
    p = target_probs_row.float()
    q = draft_q_row.to(device=device, dtype=torch.float32)
    p = p if p.stride(1) == 1 else p.contiguous()
    q = q if q.stride(1) == 1 else q.contiguous()
    u_final = u_final.to(device=device, dtype=torch.float64).contiguous()
    out = torch.empty(batch, dtype=torch.int64, device=device)
    if batch == 0:
        return out
    _random_finish_kernel[(batch,)](
        p,
        q,
        u_final,
        out,
        vocab,
        p.stride(0),
        q.stride(0),
        WEIGHT_SCALE=WEIGHT_SCALE,
        FLOAT32_MAX=FLOAT32_MAX,
        BLOCK_V=min(triton.next_power_of_2(block_v), triton.next_power_of_2(vocab)),
    )
    return out
