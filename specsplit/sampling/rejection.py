"""Rejection sampler for speculative decoding: the torch reference.

The Triton kernels in kernels/ must equal these functions exactly (torch.equal); kernels.dispatch
picks one or the other per device. RejectionSampler routes through kernels.dispatch by default.

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

from specsplit.sampling.sample import argmax_fallback, integer_weights, inverse_cdf

PAD_ID = -1


# ---------------------------------------------------------------------------------------------
# torch reference (pure functions)
# ---------------------------------------------------------------------------------------------


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

    backend: None = kernels.dispatch decides per device (Triton on CUDA, torch on CPU, or the
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
    """The reference functions under the names kernels.dispatch exposes."""

    greedy_rejection = staticmethod(greedy_rejection_ref)
    random_accept = staticmethod(random_accept_ref)
    random_finish = staticmethod(random_finish_ref)
