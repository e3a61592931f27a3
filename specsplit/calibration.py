"""Start-up calibration: each engine times its own steps, so the K policy can price a step.

Verifier: one forward of `batch` sequences with `rows` new tokens each (rows = k + 1) over a short
cached context, for every row count up to K+1 and batch sizes 1, 2, 4, ... up to --max-num-seqs
(32 at most; a large batch's GEMM regime is not a straight line from small ones); the policy
interpolates in the batch size. Drafter: one forward of `batch` sequences with one new token each,
i.e. the cost of drafting one token for the batch.

A timing on a shared 2-core VM drifts by tens of percent over seconds, so no single sample is
trusted: every shape is timed once per round over ROUNDS interleaved rounds (drift hits all shapes
alike), the estimate is the median, and the table is then fitted to be non-decreasing in rows and
in batch (a step never gets cheaper with more work; `monotone_fit`). The log line gives the
spread (the largest relative interquartile range). The whole calibration takes seconds.
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
    spread: float = 0.0  # the timings' largest relative interquartile range (noise of the table)

    def verify_s(self, batch: int, rows: int) -> float:
        """One verify forward (no network)."""
        return _interp({b: s for (b, r), s in self.verify.items() if r == rows}, batch)

    def verify_rows_s(self, batch: int, rows: int) -> float:
        """verify_s at any rows >= 1: past the largest calibrated rows, linear in the rows with the
        last two calibrated rows' slope (never decreasing); 0.0 when nothing was calibrated."""
        known = sorted({r for _, r in self.verify})
        if not known:
            return 0.0
        if rows in known or rows < known[-1]:
            return self.verify_s(batch, min((r for r in known if r >= rows), default=known[-1]))
        top = self.verify_s(batch, known[-1])
        if len(known) == 1:
            return top * rows / known[-1]
        slope = max(0.0, (top - self.verify_s(batch, known[-2])) / (known[-1] - known[-2]))
        return top + slope * (rows - known[-1])

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

    @classmethod
    def from_rows(cls, verify, draft=(), network_s: float = 0.0) -> "StepCosts":
        """as_rows read back: the wire's StepCost messages (batch, rows, seconds) of the verify and
        the draft tables."""
        return cls(verify={(c.batch, c.rows): c.seconds for c in verify}, draft={c.batch: c.seconds for c in draft},
                   network_s=network_s)


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


ROUNDS = 5  # interleaved rounds (3 for batches of 16 and more: they dominate the time)


def isotonic(values: list[float]) -> list[float]:
    """The non-decreasing sequence closest to `values` in least squares (pool adjacent violators):
    a step never gets cheaper with more rows or more sequences, whatever one noisy sample said."""
    blocks: list[list[float]] = []  # [sum, count]
    for v in values:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, c = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += c
    out: list[float] = []
    for s, c in blocks:
        out.extend([s / c] * c)
    return out


def monotone_fit(points: dict[tuple[int, int], float]) -> dict[tuple[int, int], float]:
    """(batch, rows) -> seconds made non-decreasing in rows at each batch and in batch at each row
    count (alternating 1-D fits until neither moves a point)."""
    fit = dict(points)
    batches = sorted({b for b, _ in fit})
    rows_all = sorted({r for _, r in fit})
    for _ in range(10):
        before = dict(fit)
        for b in batches:
            keys = [(b, r) for r in rows_all if (b, r) in fit]
            for k, v in zip(keys, isotonic([fit[k] for k in keys])):
                fit[k] = v
        for r in rows_all:
            keys = [(b, r) for b in batches if (b, r) in fit]
            for k, v in zip(keys, isotonic([fit[k] for k in keys])):
                fit[k] = v
        if all(abs(fit[k] - before[k]) <= 1e-12 for k in fit):
            break
    return fit


@dataclass
class Timings:
    """Repeated timings per (batch, rows): the median is the estimate, the spread its noise."""

    samples: dict[tuple[int, int], list[float]] = field(default_factory=dict)

    def medians(self) -> dict[tuple[int, int], float]:
        return {k: statistics.median(v) for k, v in self.samples.items()}

    def spread(self) -> float:
        """The largest relative interquartile range over the shapes (0.1 = 10%)."""
        out = 0.0
        for v in self.samples.values():
            if len(v) >= 3:
                q = statistics.quantiles(v, n=4)
                out = max(out, (q[2] - q[0]) / max(statistics.median(v), 1e-12))
        return out


def _measure(runner: ModelRunner, shapes: list[tuple[int, int]], rounds: int = ROUNDS) -> Timings:
    """Time every (batch, rows) forward once per round, the shapes interleaved (and their order
    rotated) so drift over the seconds calibration takes hits every shape alike; one warm-up round
    is dropped. Dummy sequences share a CONTEXT_TOKENS prefix in the cache. The forwards are
    greedy ones (ModelRunner.forward's `greedy`: the default requests' steps, whose head may skip
    most logits)."""
    max_b = max(b for b, _ in shapes)
    ids = [f"__calibrate_{i}__" for i in range(max_b)]
    context = [(7 * j + 3) % runner.vocab_size for j in range(CONTEXT_TOKENS)]
    timings = Timings({s: [] for s in shapes})
    try:
        runner.forward([ForwardItem(s, 0, context) for s in ids])
        for rnd in range(rounds + 1):
            order = shapes[rnd % len(shapes):] + shapes[:rnd % len(shapes)]
            for b, rows in order:
                if rnd > 3 and b >= 16:
                    continue
                t0 = time.perf_counter()
                runner.forward([ForwardItem(s, CONTEXT_TOKENS, context[:rows], rows) for s in ids[:b]], greedy=True)
                dt = time.perf_counter() - t0
                for s in ids[:b]:
                    runner.truncate(s, CONTEXT_TOKENS)
                if rnd > 0:
                    timings.samples[(b, rows)].append(dt)
    finally:
        for s in ids:
            runner.free(s)
    return timings


def _batches(runner: ModelRunner, max_batch: int, rows: int) -> list[int]:
    """The calibrated batch sizes that fit in the cache and under max_batch."""
    bm = runner.block_manager
    per_seq = -(-(CONTEXT_TOKENS + rows) // bm.block_size)
    fits = bm.num_free_blocks // max(per_seq, 1)
    return [b for b in BATCH_SIZES if b <= max(1, max_batch) and b <= fits]


def calibrate_verifier(runner: ModelRunner, max_k: int, max_batch: int, rounds: int = ROUNDS) -> StepCosts:
    costs = StepCosts()
    if runner.max_model_len < CONTEXT_TOKENS + max_k + 1:
        return costs
    t0 = time.perf_counter()
    shapes = [(b, rows) for b in _batches(runner, max_batch, max_k + 1) for rows in range(1, max_k + 2)]
    if not shapes:
        return costs
    timings = _measure(runner, shapes, rounds)
    costs.verify = monotone_fit(timings.medians())
    costs.spread = timings.spread()
    log.info("verifier calibration (%.1fs, %d interleaved rounds, spread %.0f%%): %s", time.perf_counter() - t0,
             rounds, 100 * costs.spread, costs.describe())
    return costs


def calibrate_drafter(runner: ModelRunner, max_batch: int, rounds: int = ROUNDS) -> StepCosts:
    costs = StepCosts()
    if runner.max_model_len < CONTEXT_TOKENS + 1:
        return costs
    t0 = time.perf_counter()
    shapes = [(b, 1) for b in _batches(runner, max_batch, 1)]
    if not shapes:
        return costs
    timings = _measure(runner, shapes, rounds)
    costs.draft = {b: s for (b, _), s in monotone_fit(timings.medians()).items()}
    costs.spread = timings.spread()
    log.info("drafter calibration (%.1fs, %d interleaved rounds, spread %.0f%%): %s", time.perf_counter() - t0,
             rounds, 100 * costs.spread, costs.describe())
    return costs
