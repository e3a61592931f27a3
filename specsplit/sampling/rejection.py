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
    greedy_rejection_ref,
    q_rows_tensor,
    random_accept_ref,
    random_finish_ref,
)


def matched_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens of a and b are equal: the drafts that the target's tokens accept
    (greedy), the part of a drafter's old chain the emitted tokens confirm, the part of a grammar
    matcher's tokens the output still holds."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


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

    @staticmethod
    def greedy_host(
        draft_ids: Sequence[Sequence[int]],  # per sequence [k_b]
        target_ids: Sequence[Sequence[int]],  # per sequence [k_b + 1]: the target's token at each row
    ) -> list[int]:  # num_accepted per sequence; emitted = target_ids[b][: num_accepted + 1]
        """`greedy` on host lists (the verifier's argmax rows come to the host anyway): the same
        rule, without building and reading back tensors each step. A step of one sequence and one
        draft took ~0.3 ms through the reference's dozen small torch ops right after a forward
        (cold caches), a few microseconds here (tests/kernels compare the two)."""
        return [matched_prefix(d, t) for d, t in zip(draft_ids, target_ids)]

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


class _TorchOps:
    """The reference functions under the names specsplit.kernels.dispatch exposes."""

    greedy_rejection = staticmethod(greedy_rejection_ref)
    random_accept = staticmethod(random_accept_ref)
    random_finish = staticmethod(random_finish_ref)
