"""Deterministic prompts over the tiny models' vocabulary (ids 3..252: no <unk>, <s>, </s>)."""
from __future__ import annotations


def spread_prompt(i: int, n: int) -> tuple[int, ...]:
    """n ids, a different sequence for each i (prompts that share no prefix unless concatenated)."""
    return tuple(3 + (i * 37 + j * 11) % 250 for j in range(n))
