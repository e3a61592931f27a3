"""Pearson's chi-square of observed sample counts against a distribution, small cells pooled."""
from __future__ import annotations

import torch
from scipy import stats


def pooled_chisquare(counts: dict, probs: dict, n: int) -> tuple[float, float]:
    """(p-value, total variation) of `counts` (cell -> samples, n in all) against `probs` (cell ->
    probability). Cells expecting fewer than 5 samples are pooled into one."""
    cells = sorted(probs)
    f_obs = torch.tensor([counts.get(c, 0) for c in cells], dtype=torch.float64)
    f_exp = torch.tensor([probs[c] for c in cells], dtype=torch.float64)
    f_exp = f_exp / f_exp.sum() * n
    tv = 0.5 * float((f_obs - f_exp).abs().sum()) / n
    big = f_exp >= 5
    f_obs = torch.cat([f_obs[big], f_obs[~big].sum().reshape(1)])
    f_exp = torch.cat([f_exp[big], f_exp[~big].sum().reshape(1)])
    if f_exp[-1] == 0:
        f_obs, f_exp = f_obs[:-1], f_exp[:-1]
    return float(stats.chisquare(f_obs.numpy(), f_exp.numpy()).pvalue), tv


def joint_fit(outputs, joint: dict) -> tuple[float, float]:
    """(p-value, total variation) of sampled outputs (token sequences) against the target's joint
    distribution of them; an output the target gives no mass fails at once."""
    counts: dict[tuple[int, ...], int] = {}
    for out in outputs:
        key = tuple(out)
        assert key in joint, f"emitted {key}, which the target gives no mass"
        counts[key] = counts.get(key, 0) + 1
    return pooled_chisquare(counts, joint, len(outputs))
