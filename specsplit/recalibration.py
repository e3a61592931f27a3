"""Re-calibration while serving: the verifier's calibrated step costs follow the machine.

Start-up calibration (calibration.py) times every (batch, rows) shape over interleaved rounds; on
a shared VM the machine then drifts (a neighbour takes the cores, turbo ends), and a K policy that
prices steps from a stale table drafts where it no longer pays, or stops where it would. Rather
than timing dummy forwards again (which would take the cores from the streams being served), every
verify call the step makes is a sample: its time against what the table predicts for its batch
and rows. When the median of the last `window` ratios leaves 1 by more than the table's own noise
(its spread, at least `min_tolerance`), the whole verify table is rescaled by that median and the
log says so. One slow step (a prefill, a pause) moves a median of 32 by nothing; the relative costs
of the shapes (what calibration measured interleaved) are kept. The drafter's table is left alone:
it may run on another host, and its calls overlap the verify.

Tried and measured (twenty-ninth session, AMD EPYC Zen 4): following a remote drafter's live
propose calls too. In a split stack a just-in-time call takes 3-6x the start-up table (the hop
into the service, the head's work in a busier process, the feature commit). Pricing each call
with that made the K policy nearly stop drafting in `specsplit bench async` (6 held-out prompts x
64 tokens):
- as a per-call cost beside the table, five runs a side alternating with the policy as it is:
  7-35 draft tokens proposed where it proposed 200-234 (22 in one run); split pre-drafting over
  target-only through the same stack 0.97x (median) against 1.05x, lockstep 0.97x against 1.01x;
  only concurrency 2 gained (1.00x against 0.96x);
- as a scale on the table, one run: 11 draft tokens, 0.95x.
A call's time is not what drafting costs the stream; one reason: the feature commit it carries is
owed whether the step drafts or not (a step that does not draft defers it to the catch-up).
"""
from __future__ import annotations

import logging
import statistics
from collections import deque

from specsplit.calibration import StepCosts

log = logging.getLogger(__name__)

WINDOW = 32  # verify calls per drift estimate
MIN_TOLERANCE = 0.15  # never rescale for less than this, whatever the start-up spread said


class Recalibration:
    def __init__(self, costs: StepCosts, window: int = WINDOW, min_tolerance: float = MIN_TOLERANCE):
        self.costs = costs  # the table the K policy reads: rescaled in place
        self.window = window
        self.min_tolerance = min_tolerance
        self._ratios: deque[float] = deque(maxlen=window)
        self.rescales = 0  # times the table was rescaled
        self.scale = 1.0  # the table now / at start-up

    @property
    def tolerance(self) -> float:
        return max(self.min_tolerance, self.costs.spread)

    def observe(self, batch: int, rows: int, seconds: float) -> float | None:
        """One verify call of `batch` sequences, `rows` rows each (the most any had), that took
        `seconds` including the network in split mode; the factor the table was rescaled by, or
        None."""
        predicted = self.costs.verify_s(batch, rows)
        if predicted <= 0 or batch <= 0 or rows <= 0:
            return None
        self._ratios.append(max(seconds - self.costs.network_s, 0.0) / predicted)
        if len(self._ratios) < self.window:
            return None
        drift = statistics.median(self._ratios)
        if abs(drift - 1.0) <= self.tolerance or drift <= 0:
            return None
        self.costs.verify = {shape: s * drift for shape, s in self.costs.verify.items()}
        self.scale *= drift
        self.rescales += 1
        self._ratios.clear()
        log.info("verify steps took %.2fx the calibrated times (median of the last %d calls, tolerance %.0f%%): "
                 "the K policy's verify costs are rescaled (now %.2fx the start-up table): %s",
                 drift, self.window, 100 * self.tolerance, self.scale, self.costs.describe())
        return drift
