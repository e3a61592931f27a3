"""Start-up calibration: each engine times its own steps, so the K policy can price a step.

Verifier: one forward of `batch` sequences with `rows` new tokens each (rows = k + 1) over a short
cached context, for every row count up to K+1 and batch sizes 1, 2, 4, ... up to --max-num-seqs
(32 at most; a large batch's GEMM regime is not a straight line from small ones); the policy
interpolates in the batch size. Drafter: one forward of `batch` sequences with one new token each, i.e. the cost
of drafting one token for the batch. Timings are medians of a few runs; the whole calibration
takes a few seconds on SmolLM2-135M and is logged in one line.
"""
from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass, field

from specsplit.models.runner import ForwardItem, ModelRunner

log = logging.getLogger(__name__)

CONTEXT_TOKENS = 64  # cached tokens per dummy sequence: a short chat turn's worth
BATCH_SIZES = (1, 2, 4, 8, 16, 32)  # up to --max-num-seqs: past the largest, linear extrapolation


@dataclass
class StepCosts:
    """Seconds per step. verify[(batch, rows)]; draft[batch] = one drafted token for the batch."""

    verify: dict[tuple[int, int], float] = field(default_factory=dict)
    draft: dict[int, float] = field(default_factory=dict)
    network_s: float = 0.0  # split mode: a round trip per engine call, measured by the gateway

    def verify_s(self, batch: int, rows: int) -> float:
        """One verify forward (no network)."""
        return _interp({b: s for (b, r), s in self.verify.items() if r == rows}, batch)

    def draft_s(self, batch: int) -> float:
        """One drafted token for the batch (no network)."""
        return _interp(self.draft, batch)

    def describe(self) -> str:
        parts = []
        for b in sorted({b for b, _ in self.verify}):
            base = self.verify.get((b, 1))
            vs = " ".join(f"{self.verify[(b, r)] / base:.2f}" for r in sorted(r for bb, r in self.verify if bb == b) if r > 1)
            parts.append(f"B={b}: {1e3 * base:.1f} ms, v(1..)={vs}")
        if self.draft:
            parts.append("draft/token " + " ".join(f"B={b}: {1e3 * s:.2f} ms" for b, s in sorted(self.draft.items())))
        return "; ".join(parts)

    def as_rows(self, kind: str) -> list[tuple[int, int, float]]:
        """(batch, rows, seconds) for the wire (rows = 1 for draft costs)."""
        if kind == "draft":
            return [(b, 1, s) for b, s in sorted(self.draft.items())]
        return [(b, r, s) for (b, r), s in sorted(self.verify.items())]


def _interp(points: dict[int, float], x: int) -> float:
    """Piecewise-linear in the batch size; linear extrapolation past the largest point (never
    decreasing)."""
    if not points:
        return 0.0
    xs = sorted(points)
    if x <= xs[0]:
        return points[xs[0]]
    for a, b in zip(xs, xs[1:]):
        if x <= b:
            return points[a] + (points[b] - points[a]) * (x - a) / (b - a)
    if len(xs) == 1:
        return points[xs[0]] * x
    a, b = xs[-2], xs[-1]
    # A larger batch never takes less time: noisy timings can make the last slope negative, and
    # extrapolating it would price a big batch below zero.
    slope = max(0.0, (points[b] - points[a]) / (b - a))
    return points[b] + slope * (x - b)


def _time(runner: ModelRunner, batch: int, rows: int, reps: int) -> float:
    ids = [f"__calibrate_{i}__" for i in range(batch)]
    context = [(7 * j + 3) % runner.vocab_size for j in range(CONTEXT_TOKENS)]
    try:
        runner.forward([ForwardItem(s, 0, context) for s in ids])
        times = []
        for _ in range((reps if batch < 16 else 1) + 1):  # the first run warms this shape
            t0 = time.perf_counter()
            runner.forward([ForwardItem(s, CONTEXT_TOKENS, context[:rows], rows) for s in ids])
            times.append(time.perf_counter() - t0)
            for s in ids:
                runner.truncate(s, CONTEXT_TOKENS)
        return statistics.median(times[1:])
    finally:
        for s in ids:
            runner.free(s)


def _batches(runner: ModelRunner, max_batch: int, rows: int) -> list[int]:
    """The calibrated batch sizes that fit in the cache and under max_batch."""
    bm = runner.block_manager
    per_seq = -(-(CONTEXT_TOKENS + rows) // bm.block_size)
    fits = bm.num_free_blocks // max(per_seq, 1)
    return [b for b in BATCH_SIZES if b <= max(1, max_batch) and b <= fits]


def calibrate_verifier(runner: ModelRunner, max_k: int, max_batch: int, reps: int = 3) -> StepCosts:
    costs = StepCosts()
    if runner.max_model_len < CONTEXT_TOKENS + max_k + 1:
        return costs
    t0 = time.perf_counter()
    for b in _batches(runner, max_batch, max_k + 1):
        for rows in range(1, max_k + 2):
            costs.verify[(b, rows)] = _time(runner, b, rows, reps)
    log.info("verifier calibration (%.1fs): %s", time.perf_counter() - t0, costs.describe())
    return costs


def calibrate_drafter(runner: ModelRunner, max_batch: int, reps: int = 3) -> StepCosts:
    costs = StepCosts()
    if runner.max_model_len < CONTEXT_TOKENS + 1:
        return costs
    t0 = time.perf_counter()
    for b in _batches(runner, max_batch, 1):
        costs.draft[b] = _time(runner, b, 1, reps)
    log.info("drafter calibration (%.1fs): %s", time.perf_counter() - t0, costs.describe())
    return costs
