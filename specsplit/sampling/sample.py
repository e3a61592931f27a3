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


def sample_from_probs(
    probs: torch.Tensor,  # [N, V] float32
    u: torch.Tensor,  # [N] float64 in [0, 1)
) -> torch.Tensor:  # [N] int64 in [0, V)
    if probs.dim() != 2:
        raise ValueError(f"probs must be [N, V], got shape {tuple(probs.shape)}")
    u = u.to(device=probs.device, dtype=torch.float64).reshape(probs.shape[0])
    ids, total = inverse_cdf(integer_weights(probs), u)
    return torch.where(total > 0, ids, argmax_fallback(probs))


def argmax_fallback(probs: torch.Tensor) -> torch.Tensor:  # [N, V] -> [N] int64
    """argmax with NaN treated as 0 (first index on ties), the fallback for zero-mass rows."""
    return torch.nan_to_num(probs.float(), nan=0.0).argmax(dim=-1)
