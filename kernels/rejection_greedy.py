"""Greedy rejection sampling: Triton kernel, host wrapper, torch reference.

One program per sequence. Accept drafts while they equal the target's argmax; the emitted ids are
the target argmax at positions 0..num_accepted (the last one is the correction, or the bonus when
all num_draft drafts were accepted), then -1.

Reference: reference.greedy_rejection_ref (beside it) (the kernel must equal it exactly).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specsplit.kernels.reference import greedy_rejection_ref as torch_reference

__all__ = ["greedy_rejection_triton", "torch_reference"]


@triton.jit
def _greedy_rejection_kernel(
    draft_ids_ptr,  # *int64 [B, K]: drafted token ids
    num_draft_ptr,  # *int64 [B]: drafts per sequence (clamped to [0, K])
    target_argmax_ptr,  # *int64 [B, K+1]: target argmax at each of the K+1 scored positions
    num_accepted_ptr,  # *int64 [B] out: accepted drafts per sequence
    out_ids_ptr,  # *int64 [B, K+1] out: emitted ids, -1 padded
    K,  # int: max drafts per sequence (columns of draft_ids)
    stride_draft,  # int: row stride of draft_ids
    stride_target,  # int: row stride of target_argmax
    stride_out,  # int: row stride of out_ids
    BLOCK_K: tl.constexpr,  # power of two >= K + 1
):
    row = tl.program_id(0).to(tl.int64)
    pos = tl.arange(0, BLOCK_K).to(tl.int64)  # [BLOCK_K]
    num_draft = tl.load(num_draft_ptr + row)
    num_draft = tl.minimum(tl.maximum(num_draft, 0), K)

    draft = tl.load(draft_ids_ptr + row * stride_draft + pos, mask=pos < K, other=-1)
    target = tl.load(target_argmax_ptr + row * stride_target + pos, mask=pos < K + 1, other=-1)

    stop = (draft != target) & (pos < num_draft)  # [BLOCK_K] first True = first rejection
    first_stop = tl.min(tl.where(stop, pos, K), axis=0)
    num_accepted = tl.minimum(first_stop, num_draft)
    tl.store(num_accepted_ptr + row, num_accepted)

    out = tl.where(pos <= num_accepted, target, -1)
    tl.store(out_ids_ptr + row * stride_out + pos, out, mask=pos < K + 1)


def greedy_rejection_triton(
    draft_ids: torch.Tensor,  # [B, K] int64
    num_draft: torch.Tensor,  # [B] int64
    target_argmax: torch.Tensor,  # [B, K+1] int64
) -> tuple[torch.Tensor, torch.Tensor]:  # num_accepted [B] int64, out_ids [B, K+1] int64
    batch, k = draft_ids.shape
    if target_argmax.shape != (batch, k + 1):
        raise ValueError(
            f"target_argmax must be [{batch}, {k + 1}], got {tuple(target_argmax.shape)}"
        )
    device = target_argmax.device
    draft_ids = draft_ids.to(device=device, dtype=torch.int64).contiguous()
    num_draft = num_draft.to(device=device, dtype=torch.int64).contiguous()
    target_argmax = target_argmax.to(torch.int64).contiguous()
    num_accepted = torch.empty(batch, dtype=torch.int64, device=device)
    out_ids = torch.empty(batch, k + 1, dtype=torch.int64, device=device)
    if batch == 0:
        return num_accepted, out_ids
    if k == 0:  # an empty tensor may have a null data pointer; the kernel never reads it
        draft_ids = target_argmax
    _greedy_rejection_kernel[(batch,)](
        draft_ids,
        num_draft,
        target_argmax,
        num_accepted,
        out_ids,
        k,
        draft_ids.stride(0),
        target_argmax.stride(0),
        out_ids.stride(0),
        BLOCK_K=triton.next_power_of_2(k + 1),
    )
    return num_accepted, out_ids
