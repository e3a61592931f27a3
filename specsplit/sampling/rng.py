"""Per-sequence randomness keyed by position: a seeded request's tokens do not depend on load.

Every uniform a sequence uses is a pure function of

    (request seed, side, absolute position, purpose)

computed by a counter-based generator (BLAKE2b as a keyed PRF over that tuple: the "counter" is
the position, the key the request's seed and the stream's name). Nothing is drawn sequentially,
so the numbers a sequence sees do not depend on how many steps it took to get somewhere, which
other sequences shared its batches, whether the scheduler preempted and recomputed it, or how a
step was cut short. (Before, each sequence drew from its own torch.Generator in step order: the
uniforms at a position then depended on how many draws earlier steps made -- K, speculation on or
off -- so the same seeded request gave other tokens under load.)

Positions are absolute indices into the sequence (prompt included): the token that lands at
index j of prompt + output. Sides and purposes:

  side "drafter",  purpose "draft":   the uniform that samples the draft token at position j
  side "verifier", purpose "accept":  the accept test of the draft at position j
  side "verifier", purpose "final":   the recovered (residual) or bonus token, or the
                                      target-only token, at position j

Why each uniform is used at most once in what a request emits: every step fixes the tokens from
its first position L up to the first rejection (or the bonus), and a fixed position is never
stepped again. Within a step, position j uses "accept" at most once (one draft per position) and
"final" at most once (only at the single position where the step stops). Positions past the step's
stop were not tested, so nothing emitted depends on their uniforms; the next step reuses them,
which is as good as fresh. A step that is abandoned as a whole (SpecDecoder's exact fallback when
the drafter is lost mid-step) emits nothing, and the decision to abandon does not look at any
uniform, so re-using its positions' uniforms is again as good as fresh. The drafter's and the
verifier's streams are different keys of the same seed: the accept test's uniforms are independent
of the ones that drew the drafts, as the rejection sampler's losslessness needs.

What keying alone does not give, for rejection sampling: the same tokens with speculation on and
off, or at another K (a position's token comes from the drafter's noise when its draft is
accepted, from the verifier's otherwise). Seeded requests therefore use the coupled scheme of
specsplit.sampling.coupled (shared Gumbel noise), which gives exactly that.
"""

from __future__ import annotations

import hashlib
import os
import struct
from typing import Sequence

import torch

_TWO_POW_53 = float(2**53)


def derive_seed(seed: int, stream: str) -> int:
    """A 63-bit seed for (request seed, stream name); stable across processes and versions."""
    digest = hashlib.blake2b(f"{seed}:{stream}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def keyed_uniform(key: bytes, position: int, purpose: str) -> float:
    """A uniform in [0, 1) with 53 random bits: BLAKE2b(key; position, purpose)."""
    digest = hashlib.blake2b(struct.pack("<q", position) + purpose.encode(), key=key, digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) / _TWO_POW_53


class SeqRandom:
    """One sequence's random numbers on one side: uniform(position, purpose) is a pure function of
    (seed, side, position, purpose). Unseeded requests get a random seed (os.urandom) per object."""

    def __init__(self, seed: int | None, stream: str = "verifier") -> None:
        base = int.from_bytes(os.urandom(8), "little") if seed is None else int(seed)
        self.seed = seed
        self.stream = stream
        self._key = hashlib.blake2b(f"specsplit:{base}:{stream}".encode(), digest_size=32).digest()

    def uniform(self, position: int, purpose: str) -> float:
        if position < 0:
            raise ValueError(f"position must be >= 0, got {position}")
        return keyed_uniform(self._key, position, purpose)

    def uniforms(self, start: int, n: int, purpose: str) -> torch.Tensor:  # [n] float64 in [0, 1)
        """uniform(start + i, purpose) for i in range(n)."""
        return torch.tensor([self.uniform(start + i, purpose) for i in range(n)], dtype=torch.float64)


def draw_step_uniforms(
    rngs: Sequence[SeqRandom],
    num_draft: Sequence[int],
    k_max: int | None = None,
    starts: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The uniforms of one verify step: u_accept [B, k_max] f64 and u_final [B] f64 (CPU).

    Sequence b's drafts land at positions starts[b] .. starts[b] + num_draft[b] - 1 (starts
    default 0): u_accept[b, j] = uniform(starts[b] + j, "accept"), and u_final[b] is the "final"
    uniform at the bonus position starts[b] + num_draft[b] (the engine draws it at the position
    where the step actually stops). Padding is 0 (never read). Independent of the batch.
    """
    if len(rngs) != len(num_draft):
        raise ValueError(f"{len(rngs)} generators for {len(num_draft)} sequences")
    if k_max is None:
        k_max = max(num_draft, default=0)
    starts = [0] * len(rngs) if starts is None else list(starts)
    u_accept = torch.zeros(len(rngs), k_max, dtype=torch.float64)
    u_final = torch.zeros(len(rngs), dtype=torch.float64)
    for b, (rng, k, start) in enumerate(zip(rngs, num_draft, starts, strict=True)):
        if k > k_max:
            raise ValueError(f"num_draft[{b}]={k} exceeds k_max={k_max}")
        u_accept[b, :k] = rng.uniforms(start, k, "accept")
        u_final[b] = rng.uniform(start + k, "final")
    return u_accept, u_final
