"""The K policy: how many tokens to draft this step, 0 included, from measured costs and acceptance.

Vocabulary:
  a_j     the acceptance rate of draft position j given positions 0..j-1 were accepted, estimated
          online per request: that request's own counts over a Beta prior centred on what the
          server has seen at that position (`Pooled`, every request's steps, recent ones weighted
          most), so a request starts where its drafter usually is and a few unlucky steps do not
          switch it off.
  d_j     the chance that a drafter asked for k > j drafts drafts position j (a drafter may stop
          early: an EAGLE-3 head where it is unsure, SpecConfig.draft_stop; prompt lookup where its
          match runs out); 1 until a request's drafter is seen to stop.
  E(k)    expected tokens a step emits with k drafts: 1 + c_0 a_0 + c_0 a_0 c_1 a_1 + ... with
          c_j = d_j / d_{j-1} (the bonus or recovered token always comes).
  R(k)    verify rows per sequence: 1 + d_0 + ... + d_{k-1}.
  T(k)    the step's time: the verifier's calibrated forward of R(k) rows per sequence at this
          batch size (interpolated between whole rows), plus drafting (a model forward per draft
          sent, R(k) - 1 <= k, or at most `model_tokens` of them when prompt lookup drafts first),
          plus the network round trips in split mode.
          With asynchronous pre-drafting (specsplit.spec) drafting is paid only when some
          sequence's pre-drafted branch missed: with probability 1 - prod_s h_s(k), where
          h_s(k) = a_0 ... a_{k-1} a_k (every draft accepted, then the bonus guessed, taken as
          likely as one more accepted draft); plus whatever the pre-draft (1 + k model tokens)
          takes beyond the verify it overlaps.
The policy picks the k in 0..K that maximizes the batch's sum of E(k) over T(k), and k = 0 unless
that beats target-only by `margin` (3%, about the calibration's noise): speculation turns itself
off wherever it cannot pay, at batch 1 or 32 alike. With k = 0 it still drafts one
token for one sequence (in turn) every `probe_every` steps while speculation could pay at all, so
a request whose text turns predictable is noticed at the cost of one verify row; where probes were
measured to cost more than `probe_budget` of the time at that rate (ProbeCost), they come less
often. Greedy output does not depend on k (verification is exact for any k).
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

from specsplit.calibration import StepCosts


# A request's own counts weigh as much as this many trials of the server's pooled rate: a
# request turns speculation off when its acceptance stays low over ~10-20 steps, not after
# two unlucky ones (with a fixed prior of 0.6 at weight 2, the default flags chose k = 0 for
# 45-63% of the steps of requests whose fixed K=1 gained 1.09-1.13x: AMD EPYC Zen 4).
REQUEST_PRIOR_WEIGHT = 8.0
# The pooled rate starts at the fixed prior with this weight, so a server's first few steps (a
# first request's early prompt-lookup misses: 1 of 6 accepted) cannot pull every request's prior
# down and switch speculation off for all of them.
POOLED_PRIOR_WEIGHT = 32.0


@dataclass
class Acceptance:
    """Per-position acceptance of one request's drafts (counted once, here). `pooled`: the server's
    acceptance over all requests, the centre of this one's prior (None: prior_rate)."""

    prior_rate: float = 0.6
    prior_weight: float = 2.0
    pooled: "Pooled | None" = None
    tried: list[int] = field(default_factory=list)  # steps that verified position j (all before it accepted)
    accepted: list[int] = field(default_factory=list)
    asked: list[int] = field(default_factory=list)  # steps whose drafter was asked for position j (k > j)
    drafted: list[int] = field(default_factory=list)  # of those, steps whose drafter drafted it

    def update(self, num_drafts: int, num_accepted: int, asked: int = 0) -> None:
        """A verified step: num_drafts drafted (asked: the k they were asked for, at least that)."""
        for j in range(max(asked, num_drafts)):
            if j >= len(self.asked):
                self.asked.append(0)
                self.drafted.append(0)
            self.asked[j] += 1
            self.drafted[j] += int(j < num_drafts)
        for j in range(min(num_drafts, num_accepted + 1)):
            if j >= len(self.tried):
                self.tried.append(0)
                self.accepted.append(0)
            self.tried[j] += 1
            self.accepted[j] += int(j < num_accepted)

    def rate(self, j: int) -> float:
        tried = self.tried[j] if j < len(self.tried) else 0
        acc = self.accepted[j] if j < len(self.accepted) else 0
        prior = self.prior_rate if self.pooled is None else self.pooled.rate(j)
        return (acc + prior * self.prior_weight) / (tried + self.prior_weight)

    def drafted_rate(self, j: int) -> float:
        """d_j: the chance position j is drafted when asked for (a prior of one full chain). A chain
        drafts position j only after j - 1, so d_j is at most d_{j-1}: a position never asked for
        yet reads as likely as the one before it, not certain."""
        d = 1.0
        for i in range(j + 1):
            asked = self.asked[i] if i < len(self.asked) else 0
            drafted = self.drafted[i] if i < len(self.drafted) else 0
            d = min(d, (drafted + 1.0) / (asked + 1.0))
        return d

    def expected_rows(self, k: int) -> float:
        """R(k): verify rows per sequence when k drafts are asked for."""
        return 1.0 + sum(self.drafted_rate(j) for j in range(k))

    def branch_hit(self, k: int) -> float:
        """The chance that a pre-drafted branch comes true: k drafts accepted, then the bonus
        guessed (taken as likely as one more accepted draft). 1 with no drafts to verify (k = 0
        has no branch and needs no drafting)."""
        if k <= 0:
            return 1.0
        p = 1.0
        for j in range(k + 1):
            p *= self.rate(j)
        return p

    def expected_tokens(self, k: int) -> float:
        total, p, before = 1.0, 1.0, 1.0
        for j in range(k):
            d = self.drafted_rate(j)
            p *= d / before * self.rate(j)  # d <= before: drafted_rate never rises with j
            before = d
            total += p
        return total


class Pooled(Acceptance):
    """The server's acceptance per draft position over every request's verified steps: the prior
    each request's own estimate starts from (Acceptance.pooled; its weight is the request's
    prior_weight). Counts past `window` trials of a position are halved, so recent requests weigh
    most and a change of workload shows within a few thousand steps."""

    def __init__(self, prior_rate: float = 0.6, prior_weight: float = POOLED_PRIOR_WEIGHT, window: int = 4096):
        super().__init__(prior_rate, prior_weight)
        self.window = window

    def update(self, num_drafts: int, num_accepted: int, asked: int = 0) -> None:
        super().update(num_drafts, num_accepted, asked)
        for j in range(len(self.tried)):
            if self.tried[j] > self.window:
                self.tried[j] //= 2
                self.accepted[j] //= 2


@dataclass
class TreeValue:
    """What a branch node of a draft tree is worth (specsplit.draft_tree): the tokens accepted
    beyond what the tree's main chain alone would have accepted, per branch node verified,
    estimated online over every tree a server verified (a prior plus counts)."""

    prior: float = 0.1
    prior_weight: float = 32.0  # nodes' worth of prior
    nodes: int = 0
    gained: int = 0

    def update(self, nodes: int, gained: int) -> None:
        self.nodes += nodes
        self.gained += gained

    @property
    def value(self) -> float:
        return (self.gained + self.prior * self.prior_weight) / (self.nodes + self.prior_weight)


def tree_nodes(costs: StepCosts | None, batch: int, k: int, expected: float, value: float, max_nodes: int,
               margin: float = 0.03, fixed_s: float = 0.0) -> int:
    """The sizing rule of draft trees: how many branch nodes each of `batch` sequences adds to its
    chain of k drafts. With n nodes a step verifies k + 1 + n rows per sequence and is expected to
    emit expected + n * value tokens (expected: E(k) of the chain, value: TreeValue.value); the
    step's other costs, the same with or without a tree (drafting the chain -- leaves need no draft
    forward --, the network), are `fixed_s` (KPolicy.step_time less the chain's verify). n is the one
    in 0..max_nodes with the most tokens per second of step, and 0 (no tree) unless that beats the
    chain by `margin` (the calibration's noise). Without calibrated costs: max_nodes (the flag alone
    decides). On a CPU where a verify row costs ~30-40% of a step, a node must be accepted about
    that often to pay, so a typical tree there is no tree."""
    if max_nodes <= 0 or k <= 0:
        return 0
    if costs is None or not costs.verify:
        return max_nodes
    rate = [(expected + n * value) / max(1e-12, fixed_s + costs.verify_rows_s(batch, k + 1 + n))
            for n in range(max_nodes + 1)]
    n = max(range(len(rate)), key=lambda i: (rate[i], -i))
    return n if rate[n] >= rate[0] * (1.0 + margin) else 0


class ProbeCost:
    """What a probe step costs beyond a k = 0 step, measured: the decoder times every step whole
    (drafting, the verify, the network), and each probe or k = 0 step's time over the price of a
    k = 0 step at its batch (T(0), so drift of the verify table cancels) is kept, the last `window`
    of each per batch.

    A probe pays a verify row, the propose call and the drafter's catch-up with every position
    emitted since it last drafted. In the split stack at two streams, with speculation off, a probe
    took 26-31 ms against 15-16 ms for a k = 0 step (a feature drafter committing ~30-45 positions
    over RPC) and gained 0.6 tokens: at one probe in 16 steps, a loss of ~3% of the time."""

    def __init__(self, window: int = 16, min_samples: int = 8):
        self.window = window
        self.min_samples = min_samples
        self._ratios: dict[tuple[int, bool], deque[float]] = {}

    def observe(self, batch: int, probe: bool, ratio: float) -> None:
        """A probe step (or a k = 0 step) of `batch` sequences took `ratio` times T(0)."""
        self._ratios.setdefault((batch, probe), deque(maxlen=self.window)).append(ratio)

    def samples(self, batch: int, probe: bool) -> int:
        return len(self._ratios.get((batch, probe), ()))

    def extra(self, batch: int) -> float | None:
        """A probe step's cost beyond a k = 0 step's, as a fraction of one (the medians'; None
        until both have min_samples at this batch)."""
        mine, base = self._ratios.get((batch, True), ()), self._ratios.get((batch, False), ())
        if len(mine) < self.min_samples or len(base) < self.min_samples:
            return None
        return max(0.0, statistics.median(mine) / statistics.median(base) - 1.0)


class KPolicy:
    def __init__(self, costs: StepCosts, max_k: int, model_tokens: int | None = None, probe_every: int = 16,
                 async_draft: bool = False, margin: float = 0.03, probe_budget: float = 0.01):
        self.costs = costs
        # Speculate only where it is expected to beat target-only by this fraction: calibration
        # times each shape a few times (large batches once), so a gain below the timing noise is
        # as likely a loss (measured: 0.95x at 32 streams with the bare argmax).
        self.margin = margin
        self.async_draft = async_draft
        self.max_k = max_k
        self.model_tokens = model_tokens  # hybrid drafter: the model drafts at most this many
        # hybrid drafter: the share of its drafting steps the model (not prompt lookup) made; a
        # lookup step costs no draft forward (SpecDecoder refreshes it each step)
        self.model_fraction = 1.0
        self.probe_every = probe_every
        self.probe_budget = probe_budget  # the share of the time probes may cost (ProbeCost)
        self.probe_cost = ProbeCost()
        self._priced: tuple[int, float] | None = None  # the last choice's batch and T(0) there
        self._since_probe = 0
        self.probing = False  # the last choice was a probe: the caller drafts for one sequence only

    def step_time(self, batch: int, k: int, hit: float = 0.0, rows: float | None = None) -> float:
        """Seconds of one step: the verify call, and with k > 0 the propose call (split mode: one
        network round trip each). hit: the chance that no sequence needs drafting just in time
        (asynchronous pre-drafting; 0 in lockstep). rows: verify rows per sequence (R(k); default
        k + 1); a drafter that stops early also computes fewer draft forwards: one per draft it
        sends, R(k) - 1 (the verify's first row is the last accepted token, which it did not draft)."""
        rows = float(k + 1) if rows is None else min(float(k + 1), max(1.0, rows))
        verify = self._verify_s(batch, rows) + self.costs.network_s
        t = verify
        if k > 0:
            drafts = rows - 1.0
            drafted = (drafts if self.model_tokens is None else min(drafts, self.model_tokens)) * self.model_fraction
            just_in_time = drafted * self.costs.draft_s(batch) + self.costs.network_s
            if not self.async_draft:
                return t + just_in_time
            ahead = (1 + k) * self.costs.draft_s(batch) + self.costs.network_s
            t += (1.0 - hit) * just_in_time + max(0.0, ahead - verify)
        return t

    def _verify_s(self, batch: int, rows: float) -> float:
        """The calibrated verify at a fractional rows per sequence: linear between whole rows."""
        lo = int(rows)
        if rows == lo:
            return self.costs.verify_s(batch, lo)
        a, b = self.costs.verify_s(batch, lo), self.costs.verify_s(batch, lo + 1)
        return a + (b - a) * (rows - lo)

    def rates(self, accs: list[Acceptance], caps: list[int] | None = None) -> list[float]:
        """Expected tokens per second of the batch for k = 0..max_k."""
        caps = caps or [self.max_k] * len(accs)
        b = len(accs)
        out = []
        for k in range(self.max_k + 1):
            hit = 1.0
            if self.async_draft:
                for a, c in zip(accs, caps):
                    hit *= a.branch_hit(min(k, c))
            rows = sum(a.expected_rows(min(k, c)) for a, c in zip(accs, caps)) / max(b, 1)
            seconds = self.step_time(b, k, hit, rows)
            if k == 0:
                self._priced = (b, seconds)  # T(0), what observe() measures probe and k = 0 steps against
            out.append(sum(a.expected_tokens(min(k, c)) for a, c in zip(accs, caps)) / seconds)
        return out

    def observe(self, k: int, seconds: float | None) -> None:
        """The step of the last choice took `seconds` (None: not one to learn from: a prompt was
        computed in it, the drafter did not answer). Probe and k = 0 steps are kept (ProbeCost)."""
        priced, self._priced = self._priced, None
        if seconds is None or priced is None or priced[1] <= 0 or (k > 0 and not self.probing):
            return
        self.probe_cost.observe(priced[0], self.probing, seconds / priced[1])

    def probe_interval(self, batch: int) -> int:
        """Steps at k = 0 between probes: probe_every, or more where a probe was measured to cost
        more than probe_budget of the time at that rate (ProbeCost)."""
        extra = self.probe_cost.extra(batch)
        if extra is None:
            return self.probe_every
        return max(self.probe_every, math.ceil(extra / self.probe_budget))

    def choose(self, accs: list[Acceptance], caps: list[int] | None = None) -> int:
        self.probing = False
        if not accs or self.max_k <= 0:
            return 0
        rates = self.rates(accs, caps)
        k = max(range(len(rates)), key=lambda i: (rates[i], -i))  # ties: the smaller k
        if rates[k] < rates[0] * (1.0 + self.margin):
            k = 0
        if k > 0:
            self._since_probe = 0
            return k
        self._since_probe += 1
        if self._since_probe >= self.probe_interval(len(accs)) and self._could_pay(len(accs)):
            self._since_probe = 0
            self.probing = True  # one sequence drafts one token: a row more, not a batch more
            return 1
        return 0

    def _could_pay(self, batch: int) -> bool:
        """Whether one draft could pay with every draft accepted (else probing is pointless)."""
        return 2 * self.step_time(batch, 0) > self.step_time(batch, 1)
