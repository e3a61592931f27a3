"""Rejection sampler for speculative decoding: the torch reference.

The Triton kernels in kernels/ must equal these functions exactly (torch.equal); specsplit.kernels.dispatch
picks one or the other per device. RejectionSampler routes through specsplit.kernels.dispatch by default.

Shapes: B sequences, K = max drafted tokens per sequence (num_draft[b] <= K may differ per row,
0 = plain decode), V = vocabulary. Rows of num_draft are clamped to [0, K].

Greedy:  accept while draft == target argmax; then emit the target argmax at the first mismatch,
         or the bonus argmax at position num_draft when everything was accepted.

Random (Leviathan et al. / Chen et al.), in two stages so the draft's full q row crosses the
network only at the first rejected position:
  accept: accept draft j while u_j < p(x_j) / q(x_j), computed as u_j * q(x_j) < p(x_j) in
          float64 (no division); stop at the first rejection.
  finish: at the stop position sample the recovered token from normalize(max(0, p - q)), or the
          bonus token from p when all drafts were accepted (q row = zeros / None). Both use the
          exact integer inverse CDF of specsplit.sampling.sample; an all-zero residual falls back
          to p, an all-zero p to argmax(p).
Drafted ids outside [0, V) are rejected (p(x) is taken as 0), never read out of bounds.
"""

from __future__ import annotations

from typing import Sequence

import torch

from specsplit.kernels.reference import (  # the torch references live beside their kernels
    PAD_ID,
    greedy_rejection_ref,
    q_rows_tensor,
    random_accept_ref,
    random_finish_ref,
)



# ---------------------------------------------------------------------------------------------
# torch reference (pure functions)
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# the sampler the engine holds
# ---------------------------------------------------------------------------------------------


class RejectionSampler:
    """Greedy and random rejection sampling over a batch.

    backend: None = specsplit.kernels.dispatch decides per device (Triton on CUDA, torch on CPU, or the
    SPECSPLIT_KERNELS override); "torch" = always this module's reference.
    """

    def __init__(self, backend: str | None = None) -> None:
        if backend not in (None, "torch"):
            raise ValueError(f"backend must be None (auto) or 'torch', got {backend!r}")
        self.backend = backend

    def _ops(self):
        if self.backend == "torch":
            return _TorchOps
        from specsplit.kernels import dispatch  # lazy: kernels imports this module for its references

        return dispatch

    def greedy(
        self,
        draft_ids: torch.Tensor,  # [B, K] int64
        num_draft: torch.Tensor,  # [B] int64
        target_argmax: torch.Tensor,  # [B, K+1] int64
    ) -> tuple[torch.Tensor, torch.Tensor]:  # num_accepted [B], out_ids [B, K+1] (-1 pad)
        return self._ops().greedy_rejection(draft_ids, num_draft, target_argmax)

    def accept(
        self,
        draft_ids: torch.Tensor,  # [B, K] int64
        draft_q: torch.Tensor,  # [B, K] float32
        num_draft: torch.Tensor,  # [B] int64
        target_probs: torch.Tensor,  # [B, K+1, V] float32
        u_accept: torch.Tensor,  # [B, K] float64
    ) -> torch.Tensor:  # num_accepted [B] int64
        return self._ops().random_accept(draft_ids, draft_q, num_draft, target_probs, u_accept)

    def finish(
        self,
        target_probs_row: torch.Tensor,  # [B, V] float32
        draft_q_row: torch.Tensor | Sequence[torch.Tensor | None] | None,  # [B, V] / None rows
        u_final: torch.Tensor,  # [B] float64
    ) -> torch.Tensor:  # ids [B] int64
        q = q_rows_tensor(draft_q_row, target_probs_row)
        return self._ops().random_finish(target_probs_row, q, u_final)

    def sample_full(
        self,
        draft_ids: torch.Tensor,  # [B, K] int64
        draft_q_full: torch.Tensor,  # [B, K, V] float32: the draft's full q rows
        num_draft: torch.Tensor,  # [B] int64
        target_probs: torch.Tensor,  # [B, K+1, V] float32
        u_accept: torch.Tensor,  # [B, K] float64
        u_final: torch.Tensor,  # [B] float64
    ) -> tuple[torch.Tensor, torch.Tensor]:  # num_accepted [B], out_ids [B, K+1] (-1 pad)
        """Both stages at once, when all q rows are at hand (in-process, n-gram one-hot q)."""
        batch, k = draft_ids.shape
        device = target_probs.device
        ids = draft_ids.to(device=device, dtype=torch.int64)
        draft_q_full = draft_q_full.to(device)
        vocab = target_probs.shape[-1]
        if k:
            q_x = draft_q_full.gather(2, ids.clamp(0, vocab - 1)[:, :, None])[:, :, 0]  # [B, K]
        else:
            q_x = torch.zeros(batch, 0, dtype=torch.float32, device=device)
        num_accepted = self.accept(ids, q_x, num_draft, target_probs, u_accept)
        p_row = gather_stop_rows(target_probs, num_accepted)  # [B, V]
        num_draft_c = num_draft.to(device=device, dtype=torch.int64).clamp(0, k)
        if k:
            q_row = gather_stop_rows(draft_q_full, num_accepted.clamp(max=k - 1))  # [B, V]
            q_row = torch.where((num_accepted < num_draft_c)[:, None], q_row.float(), 0.0)
        else:
            q_row = torch.zeros_like(p_row, dtype=torch.float32)
        final = self.finish(p_row, q_row, u_final)
        return num_accepted, assemble_out_ids(ids, num_accepted, final)


class _TorchOps:
    """The reference functions under the names specsplit.kernels.dispatch exposes."""

    greedy_rejection = staticmethod(greedy_rejection_ref)
    random_accept = staticmethod(random_accept_ref)
    random_finish = staticmethod(random_finish_ref)
