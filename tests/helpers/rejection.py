"""Both rejection-sampling stages in one call, for the sampler's distribution tests.

The engine runs the same two stages (`RejectionSampler.accept`, then `.finish` on the row where
each sequence stops; specsplit/engine.py `_verify_sampled` and `resolve`), with the q row fetched
from the drafter only when a sampled draft was rejected. Here all q rows are at hand, so the
composition is one function; it lives with the tests because the engine never needs it whole.
"""
from __future__ import annotations

import torch

from specsplit.kernels.reference import PAD_ID
from specsplit.sampling.rejection import RejectionSampler


def gather_stop_rows(
    probs: torch.Tensor,  # [B, K', V]
    num_accepted: torch.Tensor,  # [B] int64
) -> torch.Tensor:  # [B, V]: probs[b, num_accepted[b]]
    rows = torch.arange(probs.shape[0], device=probs.device)
    return probs[rows, num_accepted.to(probs.device)]


def assemble_out_ids(
    draft_ids: torch.Tensor,  # [B, K] int64
    num_accepted: torch.Tensor,  # [B] int64
    final_ids: torch.Tensor,  # [B] int64
) -> torch.Tensor:  # [B, K+1] int64: accepted drafts, then final id, then -1
    batch, k = draft_ids.shape
    out = torch.full((batch, k + 1), PAD_ID, dtype=torch.int64, device=draft_ids.device)
    pos = torch.arange(k + 1, device=draft_ids.device)[None, :]  # [1, K+1]
    padded = torch.cat([draft_ids.to(torch.int64), out[:, :1]], dim=1)  # [B, K+1]
    out = torch.where(pos < num_accepted[:, None], padded, out)
    return out.scatter(1, num_accepted[:, None], final_ids[:, None].to(torch.int64))


def sample_full(
    sampler: RejectionSampler,
    draft_ids: torch.Tensor,  # [B, K] int64
    draft_q_full: torch.Tensor,  # [B, K, V] float32: the draft's full q rows
    num_draft: torch.Tensor,  # [B] int64
    target_probs: torch.Tensor,  # [B, K+1, V] float32
    u_accept: torch.Tensor,  # [B, K] float64
    u_final: torch.Tensor,  # [B] float64
) -> tuple[torch.Tensor, torch.Tensor]:  # num_accepted [B], out_ids [B, K+1] (-1 pad)
    batch, k = draft_ids.shape
    device = target_probs.device
    ids = draft_ids.to(device=device, dtype=torch.int64)
    draft_q_full = draft_q_full.to(device)
    vocab = target_probs.shape[-1]
    if k:
        q_x = draft_q_full.gather(2, ids.clamp(0, vocab - 1)[:, :, None])[:, :, 0]  # [B, K]
    else:
        q_x = torch.zeros(batch, 0, dtype=torch.float32, device=device)
    num_accepted = sampler.accept(ids, q_x, num_draft, target_probs, u_accept)
    p_row = gather_stop_rows(target_probs, num_accepted)  # [B, V]
    num_draft_c = num_draft.to(device=device, dtype=torch.int64).clamp(0, k)
    if k:
        q_row = gather_stop_rows(draft_q_full, num_accepted.clamp(max=k - 1))  # [B, V]
        q_row = torch.where((num_accepted < num_draft_c)[:, None], q_row.float(), 0.0)
    else:
        q_row = torch.zeros_like(p_row, dtype=torch.float32)
    final = sampler.finish(p_row, q_row, u_final)
    return num_accepted, assemble_out_ids(ids, num_accepted, final)
