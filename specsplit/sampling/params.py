"""Per-request sampling parameters."""
from __future__ import annotations

import math
from dataclasses import dataclass

MIN_TEMPERATURE = 1e-2  # below it: 0 (greedy) or an error; see SamplingParams.validate
MAX_TEMPERATURE = 1e4  # above it the distribution is uniform to float32 precision


@dataclass(frozen=True)
class SamplingParams:
    """How one request turns logits into tokens.

    temperature == 0 means greedy (argmax); top_k <= 0 and top_p == 1 switch those filters off.
    The same transform is applied to the target's p and the draft's q, so rejection sampling
    reproduces the distribution the target alone would sample from.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    # How a seeded sampled request speculates. None (the default): coupled -- the drafter and the
    # target share per-position Gumbel noise (specsplit.sampling.coupled), so the tokens are the
    # target-only tokens of that seed whatever the speculation does. False: rejection sampling
    # (highest acceptance; reproducible only under the same speculation schedule). Unseeded
    # requests always use rejection sampling.
    coupling: bool | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def coupled(self) -> bool:
        """Sampled with shared noise: the verifier needs no q(x) and no q rows."""
        return self.temperature != 0.0 and self.seed is not None and self.coupling is not False

    @property
    def accepts_by_match(self) -> bool:
        """Greedy or coupled: the verifier accepts a draft when it equals the target's own token at
        that position (no q(x), no q rows cross); otherwise the rejection sampler runs on q."""
        return self.greedy or self.coupled

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError with a message a client can act on. The one place these rules live:
        the gateway, `specsplit generate` and the engines (for what peers send) all call it.

        temperature: 0 (greedy) or in [MIN_TEMPERATURE, MAX_TEMPERATURE]. Sampling divides the
        logits by it in float32; below 1e-2 a logit of a few hundred becomes an overflow (1e-40
        turned every logit into inf, the probabilities into NaN and the output into token 0), and
        it is already greedy in effect: a runner-up 0.2 logits behind has probability < e**-20.
        NaN and inf are refused in every float.
        """
        t, p = self.temperature, self.top_p
        if not math.isfinite(t) or t < 0.0 or 0.0 < t < MIN_TEMPERATURE or t > MAX_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}], got {t:g}")
        if not math.isfinite(p) or not (0.0 < p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {p:g}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if vocab_size is not None and self.top_k > vocab_size:
            raise ValueError(f"top_k must be <= the vocabulary size {vocab_size} (0 = off), got {self.top_k}")
        if self.seed is not None and not (0 <= self.seed < 2**64):
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")
