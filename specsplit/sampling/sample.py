"""Sampling a token from a probability row by an exact integer inverse CDF.

Float cumulative sums depend on summation order, so a torch cumsum and a Triton tiled scan would
disagree on rare boundary draws. Instead each probability is turned into an integer weight

    w = floor(prob * 2**44)            (exact: scaling by a power of two, then flooring)

and the CDF is an int64 cumsum (exact, order-independent). With total = sum(w):

    threshold = int64(floor(u * float64(total)))    clamped to total - 1
    token     = first index i with cumsum[i] > threshold  (= count of cumsum <= threshold)

so torch and Triton agree bit for bit given the same uniform u in [0, 1).

Truncation: every entry loses less than 2**-44 of mass, i.e. at most V * 2**-44 in total
(about 9e-9 for V = 151936) -- far below anything a statistical test can see. Tokens with
prob < 2**-44 get weight 0 and are never sampled. A row whose weights are all zero (all-zero
input, or every entry below 2**-44) falls back to argmax, so ids are always in [0, V).
"""

from __future__ import annotations

import torch

from specsplit.kernels.reference import WEIGHT_BITS, WEIGHT_SCALE, argmax_fallback, integer_weights, inverse_cdf

__all__ = ["WEIGHT_BITS", "WEIGHT_SCALE", "argmax_fallback", "integer_weights", "inverse_cdf", "sample_from_probs"]

def sample_from_probs(
    probs: torch.Tensor,  # [N, V] float32
    u: torch.Tensor,  # [N] float64 in [0, 1)
) -> torch.Tensor:  # [N] int64 in [0, V)
    if probs.dim() != 2:
        raise ValueError(f"probs must be [N, V], got shape {tuple(probs.shape)}")
    u = u.to(device=probs.device, dtype=torch.float64).reshape(probs.shape[0])
    ids, total = inverse_cdf(integer_weights(probs), u)
    return torch.where(total > 0, ids, argmax_fallback(probs))
