"""Coupled speculative sampling for seeded requests: the drafter and the target share noise.

For a seeded sampled request both sides use the same Gumbel noise g_j (one value per vocabulary
entry) at each absolute position j, a pure function of (seed, j):

    drafter  x_j = argmax_v  log q_j(v) + g_j(v)      (q: the draft's probabilities)
    target   y_j = argmax_v  log p_j(v) + g_j(v)      (p: the target's, same transform)

The verifier accepts drafts while x_j == y_j and emits y at the first mismatch (or the bonus
y_{L+k} when all k are accepted). Every emitted token is therefore y_j = argmax(log p_j + g_j)
given the emitted prefix: exactly what the target alone produces with that noise, which is an
exact sample from p_j (the Gumbel-max trick: g_j is independent of the prefix, since the prefix
depends only on the noise at earlier positions). So:

  * lossless: the emitted distribution is the target's;
  * the tokens of a seed do not depend on speculation on or off, K, the drafter (model, n-gram,
    none, or one that failed mid-step), the batch, load or preemption;
  * the verifier needs no q(x) and no q rows (nothing to lose when the drafter is lost mid-step).

The price: P(x_j == y_j) under this coupling is below the maximal coupling's sum(min(p, q)) that
rejection sampling reaches, so seeded requests accept somewhat fewer drafts than unseeded ones.
A seeded request that prefers acceptance over reproducibility sets SamplingParams.coupling=False.
"""
from __future__ import annotations

import hashlib

import torch

from specsplit.sampling.probs import greedy_ids


def _position_seed(seed: int, position: int) -> int:
    digest = hashlib.blake2b(f"specsplit-coupled:{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def gumbel_noise(seed: int, position: int, vocab: int) -> torch.Tensor:  # [vocab] float64
    """The shared noise at one absolute position of a seeded sequence (same on both sides)."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(_position_seed(seed, position))
    u = torch.rand(vocab, dtype=torch.float64, generator=gen)
    return -torch.log(-torch.log(u))  # u == 0 gives -inf: that entry never wins


def coupled_sample(probs: torch.Tensor, seed: int, position: int) -> int:
    """argmax(log probs + g) for one row [V]: an exact sample from probs, shared by both sides."""
    g = gumbel_noise(seed, position, probs.shape[-1])
    logp = torch.log(probs.detach().to(device="cpu", dtype=torch.float64))  # 0 -> -inf: never chosen
    return int(greedy_ids(logp + g))
