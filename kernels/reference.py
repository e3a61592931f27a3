"""Torch references of the kernels beside them (rejection_greedy.py, rejection_random.py), and
the exact integer sampler they share. The Triton kernels must equal these functions exactly
(torch.equal); dispatch.py picks one or the other per device. The engine reaches them through
specsplit.sampling (sample.py re-exports the sampler, rejection.py wraps the rejection steps in
RejectionSampler); shapes and the math are in specsplit/sampling/rejection.py's docstring.

Exact integer sampling: probabilities are turned into integer weights floor(p * 2**44) and a
uniform u picks the first index whose cumulative weight exceeds floor(u * total), so the draw is
the same on every device and in every kernel.
"""
from __future__ import annotations

from typing import Sequence

import torch

PAD_ID = -1  # an output slot past the emitted tokens
WEIGHT_BITS = 44
WEIGHT_SCALE = float(2**WEIGHT_BITS)


def integer_weights(probs: torch.Tensor) -> torch.Tensor:  # [..., V] float32 -> [..., V] int64
    """floor(clamp(probs, 0, 1) * 2**44) as int64, exactly; NaN and negatives count as 0."""
    probs = probs.float()
    probs = torch.where(probs > 0, probs, 0.0).clamp_(max=1.0)
    return torch.floor_(probs.mul_(WEIGHT_SCALE)).to(torch.int64)


def inverse_cdf(
    weights: torch.Tensor,  # [N, V] int64, non-negative
    u: torch.Tensor,  # [N] float64 in [0, 1)
) -> tuple[torch.Tensor, torch.Tensor]:  # ids [N] int64, total [N] int64
    """Index of the first cumsum > floor(u * total); ids are garbage where total == 0."""
    cdf = weights.cumsum(dim=-1)  # [N, V] int64
    total = cdf[:, -1]  # [N]
    threshold = torch.floor(u.to(torch.float64) * total.to(torch.float64)).to(torch.int64)
    threshold = torch.minimum(threshold, total - 1)  # [N]
    ids = (cdf <= threshold[:, None]).sum(dim=-1)  # [N]
    return ids.clamp(max=weights.shape[-1] - 1), total


def argmax_fallback(probs: torch.Tensor) -> torch.Tensor:  # [N, V] -> [N] int64
    """argmax with NaN treated as 0 (first index on ties), the fallback for zero-mass rows."""
    return torch.nan_to_num(probs.float(), nan=0.0).argmax(dim=-1)


def _first_stop(
    ok: torch.Tensor,  # [B, K] bool, True = accepted at this position
    num_draft: torch.Tensor,  # [B] int64 in [0, K]
) -> torch.Tensor:  # [B] int64: index of the first False below num_draft, else num_draft
    batch, k = ok.shape
    if k == 0:
        return num_draft.clone()
    pos = torch.arange(k, device=ok.device)[None, :].expand(batch, k)  # [B, K]
    stop = (~ok) & (pos < num_draft[:, None])  # [B, K]
    first = torch.where(stop, pos, k).amin(dim=-1)  # [B]
    return torch.minimum(first, num_draft)


def greedy_rejection_ref(
    draft_ids: torch.Tensor,  # [B, K] int64
    num_draft: torch.Tensor,  # [B] int64
    target_argmax: torch.Tensor,  # [B, K+1] int64
) -> tuple[torch.Tensor, torch.Tensor]:  # num_accepted [B] int64, out_ids [B, K+1] int64 (-1 pad)
    batch, k = draft_ids.shape
    device = target_argmax.device
    num_draft = num_draft.to(device=device, dtype=torch.int64).clamp(0, k)
    target_argmax = target_argmax.to(torch.int64)
    match = draft_ids.to(device=device, dtype=torch.int64) == target_argmax[:, :k]  # [B, K]
    num_accepted = _first_stop(match, num_draft)  # [B]
    pos = torch.arange(k + 1, device=device)[None, :]  # [1, K+1]
    out_ids = torch.where(pos <= num_accepted[:, None], target_argmax, PAD_ID)  # [B, K+1]
    return num_accepted, out_ids


def random_accept_ref(
    draft_ids: torch.Tensor,  # [B, K] int64
    draft_q: torch.Tensor,  # [B, K] float32: q(x_j) of each drafted id
    num_draft: torch.Tensor,  # [B] int64
    target_probs: torch.Tensor,  # [B, K+1, V] float32 (K+1 rows; only the first K are read)
    u_accept: torch.Tensor,  # [B, K] float64 in [0, 1)
) -> torch.Tensor:  # num_accepted [B] int64
    batch, k = draft_ids.shape
    vocab = target_probs.shape[-1]
    device = target_probs.device
    num_draft = num_draft.to(device=device, dtype=torch.int64).clamp(0, k)
    if k == 0:
        return num_draft
    ids = draft_ids.to(device=device, dtype=torch.int64)
    valid = (ids >= 0) & (ids < vocab)  # [B, K]
    p_x = target_probs[:, :k, :].gather(2, ids.clamp(0, vocab - 1)[:, :, None])[:, :, 0]  # [B,K]
    p_x = torch.where(valid, p_x.float(), 0.0)
    q_x = draft_q.to(device=device, dtype=torch.float32).double()  # via float32, as the kernel
    u = u_accept.to(device=device, dtype=torch.float64)
    accepted = u * q_x < p_x.double()  # [B, K]
    return _first_stop(accepted, num_draft)


def random_finish_ref(
    target_probs_row: torch.Tensor,  # [B, V] float32: p at each row's stop position
    draft_q_row: torch.Tensor,  # [B, V] float32: q there, zeros where all drafts were accepted
    u_final: torch.Tensor,  # [B] float64 in [0, 1)
) -> torch.Tensor:  # ids [B] int64 in [0, V)
    p = target_probs_row.float()
    residual = p - draft_q_row.to(
        device=p.device, dtype=torch.float32
    )  # [B, V] float32; negatives get weight 0 = max(0, p - q)
    w_residual = integer_weights(residual)  # [B, V] int64
    use_residual = w_residual.sum(dim=-1) > 0  # [B] bool; else bonus / fallback: sample from p
    weights = torch.where(use_residual[:, None], w_residual, integer_weights(p))  # [B, V]
    ids, total = inverse_cdf(weights, u_final.to(device=p.device, dtype=torch.float64))
    return torch.where(total > 0, ids, argmax_fallback(p))


def q_rows_tensor(
    draft_q_row: torch.Tensor | Sequence[torch.Tensor | None] | None,
    like: torch.Tensor,  # [B, V] the target rows, for shape / device
) -> torch.Tensor:  # [B, V] float32, zeros for None (= bonus from p)
    """Normalise the finish-stage q rows: a [B, V] tensor, a list with None entries, or None."""
    if draft_q_row is None:
        return torch.zeros_like(like, dtype=torch.float32)
    if isinstance(draft_q_row, torch.Tensor):
        if draft_q_row.shape != like.shape:
            raise ValueError(f"draft_q_row shape {tuple(draft_q_row.shape)} != {tuple(like.shape)}")
        return draft_q_row.to(device=like.device, dtype=torch.float32)
    if len(draft_q_row) != like.shape[0]:
        raise ValueError(f"{len(draft_q_row)} q rows for {like.shape[0]} sequences")
    out = torch.zeros_like(like, dtype=torch.float32)
    for b, row in enumerate(draft_q_row):
        if row is not None:
            out[b] = row.to(device=like.device, dtype=torch.float32).reshape(-1)
    return out
