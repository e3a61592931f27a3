"""Re-calibration while serving: the K policy's calibrated step costs follow the machine.

Start-up calibration (calibration.py) times every (batch, rows) shape over interleaved rounds; on
a shared VM the machine then drifts (a neighbour takes the cores, turbo ends), and a K policy that
prices steps from a stale table drafts where it no longer pays, or stops where it would. Rather
than timing dummy forwards again (which would take the cores from the streams being served), every
call the step makes is a sample: its time against what the table predicts for it. When the window
of the last `window` samples says the calls take other than the table by more than the table's own
noise (its spread, at least `min_tolerance`), that table is rescaled by the factor and the log says
so. The relative costs of the shapes (what calibration measured interleaved) are kept.

- `Recalibration`, the verify table: each verify call of `batch` sequences and `rows` rows; the
  estimate is the median of the window's ratios, so one slow step (a prefill, a pause) moves it by
  nothing.
- `DraftRecalibration`, the draft table: each just-in-time propose call, against the price the K
  policy gave it (`KPolicy.drafted`: the model's draft forwards, a hybrid's share of lookup steps
  counted as costing none). What a drafter call costs is known only on average: a hybrid's call
  either drafts with its model or only ingests (lookup drafted), and the gateway cannot tell which,
  so the per-call ratios are two clusters and their median belongs to one of them (trimming the
  extremes would cut one cluster more than the other). The estimate is a median of means: the
  window is cut into GROUPS runs of consecutive calls, each run's ratio is its sums' (both kinds of
  call in it), and the median of the runs' ratios is taken, so a pause moves one run only.
  Only for a remote drafter (`DrafterTraits.remote`, a drafter service's client). Its table was
  timed in the drafter's own process on a short context; its calls come over gRPC into a busier
  process (a propose round trip costs 1.3-1.6 ms more than the call in-process, where the GetInfo
  pings that set `network_s` read ~0.7 ms), and the first rescales of a split stack read 3.6x, then
  1.2x and 1.4x more. An in-process drafter's calls are the code its table timed; what they add
  beyond it includes the feature commit of a hybrid's lookup steps, which the policy leaves out
  on purpose (a step that does not draft defers the commit to the catch-up, it does not avoid
  it). Measured on a 2-core AMD EPYC (Zen 4), default draft, 6 chat prompts x 160 tokens,
  interleaved: split stack 1.07x tok/s with it (5 rounds, 1.02-1.12x), colocated 0.97x (3 rounds).
"""
from __future__ import annotations

import logging
import statistics
from collections import deque

from specsplit.calibration import StepCosts

log = logging.getLogger(__name__)

WINDOW = 32  # calls per drift estimate
MIN_TOLERANCE = 0.15  # never rescale for less than this, whatever the start-up spread said
GROUPS = 4  # DraftRecalibration: runs of consecutive calls per window (a median of their means)


class _Drift:
    """A window of (observed, predicted) seconds and the rescale rule both tables share."""

    what = ""  # the log's name for the calls

    def __init__(self, costs: StepCosts, window: int = WINDOW, min_tolerance: float = MIN_TOLERANCE):
        self.costs = costs  # the table the K policy reads: rescaled in place
        self.window = window
        self.min_tolerance = min_tolerance
        self._samples: deque[tuple[float, float]] = deque(maxlen=window)  # (observed, predicted) s
        self.rescales = 0  # times the table was rescaled
        self.scale = 1.0  # the table now / at start-up

    @property
    def tolerance(self) -> float:
        return max(self.min_tolerance, self.costs.spread)

    def _estimate(self) -> float:
        raise NotImplementedError

    def _rescale(self, factor: float) -> None:
        raise NotImplementedError

    def _record(self, seconds: float, predicted: float) -> float | None:
        """One call that took `seconds` (the network included, in split mode) where the table said
        `predicted` (without it); the factor the table was rescaled by, or None."""
        if predicted <= 0:
            return None
        self._samples.append((max(seconds - self.costs.network_s, 0.0), predicted))
        if len(self._samples) < self.window:
            return None
        drift = self._estimate()
        if abs(drift - 1.0) <= self.tolerance or drift <= 0:
            return None
        self._rescale(drift)
        self.scale *= drift
        self.rescales += 1
        self._samples.clear()
        log.info("%s took %.2fx the calibrated times (the last %d calls, tolerance %.0f%%): the K policy's costs are "
                 "rescaled (now %.2fx the start-up table): %s",
                 self.what, drift, self.window, 100 * self.tolerance, self.scale, self.costs.describe())
        return drift


class Recalibration(_Drift):
    """The verify table (StepCosts.verify)."""

    what = "verify steps"

    def observe(self, batch: int, rows: int, seconds: float) -> float | None:
        """One verify call of `batch` sequences, `rows` rows each (the most any had), that took
        `seconds` including the network in split mode; the factor the table was rescaled by, or
        None."""
        if batch <= 0 or rows <= 0:
            return None
        return self._record(seconds, self.costs.verify_s(batch, rows))

    def _estimate(self) -> float:
        return statistics.median(o / p for o, p in self._samples)

    def _rescale(self, factor: float) -> None:
        self.costs.verify = {shape: s * factor for shape, s in self.costs.verify.items()}


class DraftRecalibration(_Drift):
    """The draft table (StepCosts.draft)."""

    what = "drafter calls"

    def observe(self, batch: int, drafted: float, seconds: float) -> float | None:
        """One just-in-time propose call for `batch` sequences that the K policy priced at
        `drafted` draft forwards (KPolicy.drafted), which took `seconds` including the network in
        split mode; the factor the table was rescaled by, or None."""
        if batch <= 0 or drafted <= 0:
            return None
        return self._record(seconds, drafted * self.costs.draft_s(batch))

    def _estimate(self) -> float:
        calls, n = list(self._samples), len(self._samples)
        runs = [calls[i * n // GROUPS:(i + 1) * n // GROUPS] for i in range(GROUPS)]
        return statistics.median(sum(o for o, _ in r) / sum(p for _, p in r) for r in runs if r)

    def _rescale(self, factor: float) -> None:
        self.costs.draft = {b: s * factor for b, s in self.costs.draft.items()}
