"""Measured step costs for the speedup model S = E / (k c + v(k) + o).

c    = time of one draft forward (1 token) / time of one target forward (1 token); a feature
       drafter (no runner of its own) gives its calibrated cost per drafted token
v(k) = time of a target forward over k+1 tokens / time of one over 1 token
E    = expected tokens per step with per-token acceptance a: (1 - a^(k+1)) / (1 - a)
o is the per-step overhead not in either forward; the prediction sets it to 0, so the gap between
predicted and measured speedup is that overhead.
"""
from __future__ import annotations

import statistics
import time

from specsplit.feature_drafter import FeatureDrafter, calibrate_feature_drafter
from specsplit.models.runner import ForwardItem, ModelRunner


def _time_forward(runner: ModelRunner, prompt: list[int], q: int, reps: int = 7) -> float:
    seq = "__cost__"
    runner.forward([ForwardItem(seq, 0, prompt)])
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        runner.forward([ForwardItem(seq, len(prompt), list(prompt[:q]) or [0] * q, q)])
        times.append(time.perf_counter() - t0)
        runner.truncate(seq, len(prompt))
    runner.free(seq)
    return statistics.median(times)


def measure_costs(colo, prompt: list[int], ks: list[int]) -> dict:
    target = colo.target.runner
    t1 = _time_forward(target, prompt, 1)
    out = {"target_step_ms": 1000 * t1, "v": {}}
    for k in ks:
        out["v"][k] = _time_forward(target, prompt, k + 1) / t1
    drafter = getattr(colo.drafter, "runner", None)
    feature = getattr(colo.drafter, "model", colo.drafter)  # a hybrid's model draft, or the drafter itself
    if drafter is not None:
        d1 = _time_forward(drafter, prompt, 1)
    elif isinstance(feature, FeatureDrafter):  # no runner of its own: the head's calibration (a fixed-K
        costs = feature.step_costs or calibrate_feature_drafter(feature, 1)  # server skips it)
        d1 = costs.draft_s(1)
    else:
        d1 = 0.0  # n-gram lookup: no forward
    if d1:
        out["draft_step_ms"] = 1000 * d1
    out["c"] = d1 / t1
    return out


def expected_tokens(acceptance: float, k: int) -> float:
    if acceptance >= 1.0:
        return k + 1.0
    return (1 - acceptance ** (k + 1)) / (1 - acceptance)


def predicted_speedup(tokens_per_step: float, k: int, costs: dict) -> float:
    """S with E = measured tokens per speculative step (mean accepted + 1) and o = 0."""
    v = costs["v"].get(k)
    if v is None:
        return float("nan")
    return tokens_per_step / (k * costs["c"] + v)
