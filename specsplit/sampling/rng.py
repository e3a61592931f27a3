"""Per-sequence randomness that does not depend on which other sequences share the batch.

Each sequence owns one SeqRandom per side (drafter, verifier) and draws from it in a fixed
pattern per step, so a seeded request produces the same tokens whatever it is batched with.
Generators are never shared between sequences.

The drafter and the verifier MUST use different streams of the same seed: the rejection test is
lossless only if its uniforms are independent of the ones that drew the draft tokens. `stream`
derives a separate, reproducible seed per use ("draft", "verify", ...).
"""

from __future__ import annotations

import hashlib
import os
from typing import Sequence

import torch


def derive_seed(seed: int, stream: str) -> int:
    """A 63-bit seed for (request seed, stream name); stable across processes and versions."""
    digest = hashlib.blake2b(f"{seed}:{stream}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class SeqRandom:
    """A CPU torch.Generator seeded from the request's seed (or os.urandom when unseeded)."""

    def __init__(self, seed: int | None, stream: str = "verify") -> None:
        if seed is None:
            base = int.from_bytes(os.urandom(8), "little")
        else:
            base = int(seed)
        self.seed = seed
        self.stream = stream
        self.generator = torch.Generator(device="cpu")
        self.generator.manual_seed(derive_seed(base, stream))

    def uniforms(self, n: int) -> torch.Tensor:  # [n] float64 in [0, 1)
        return torch.rand(n, generator=self.generator, dtype=torch.float64)

    def get_state(self) -> torch.Tensor:
        return self.generator.get_state()

    def set_state(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)


def draw_step_uniforms(
    rngs: Sequence[SeqRandom],
    num_draft: Sequence[int],
    k_max: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The uniforms of one verify step: u_accept [B, k_max] f64 and u_final [B] f64 (CPU).

    Sequence b draws exactly num_draft[b] accept uniforms then one final uniform from its own
    generator; padding positions are 0 (never read). So each sequence's stream depends only on its
    own draft lengths, not on the batch.
    """
    if len(rngs) != len(num_draft):
        raise ValueError(f"{len(rngs)} generators for {len(num_draft)} sequences")
    if k_max is None:
        k_max = max(num_draft, default=0)
    u_accept = torch.zeros(len(rngs), k_max, dtype=torch.float64)
    u_final = torch.zeros(len(rngs), dtype=torch.float64)
    for b, (rng, k) in enumerate(zip(rngs, num_draft, strict=True)):
        if k > k_max:
            raise ValueError(f"num_draft[{b}]={k} exceeds k_max={k_max}")
        draws = rng.uniforms(k + 1)
        u_accept[b, :k] = draws[:k]
        u_final[b] = draws[k]
    return u_accept, u_final
