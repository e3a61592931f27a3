"""Re-calibration while serving (specsplit/recalibration.py): the verify table follows a drift of
the live verify calls beyond its noise, never one slow step, and keeps the shapes' relative costs;
the draft table follows the just-in-time propose calls on average (a hybrid's calls come in two
kinds), never a pause; a colocated server whose tables are stale rescales them from its own steps,
output unchanged."""
from __future__ import annotations

import pytest

from specsplit.calibration import StepCosts
from specsplit.config import EngineConfig, SpecConfig
from specsplit.factory import build_colocated, colocated_decoder
from specsplit.recalibration import DraftRecalibration, Recalibration
from specsplit.request import GenerationRequest
from specsplit.scheduler import Scheduler
from tests.helpers.greedy import assert_outputs_equal_or_tie


def _table(spread: float = 0.05) -> StepCosts:
    return StepCosts(verify={(b, r): 0.01 * b * (1 + 0.3 * (r - 1)) for b in (1, 2, 4) for r in (1, 2, 3)},
                     draft={1: 0.002}, spread=spread)


def _feed(rc: Recalibration, factors, base: float = _table().verify_s(2, 3)) -> list[float | None]:
    """Verify calls of 2 sequences x 3 rows on a machine `factor` times as slow as at start-up."""
    return [rc.observe(2, 3, f * base + rc.costs.network_s) for f in factors]


def test_within_the_tolerance_nothing_moves():
    costs = _table()
    before = dict(costs.verify)
    rc = Recalibration(costs, window=8)
    assert all(f is None for f in _feed(rc, [0.9, 1.1, 1.12, 0.88] * 10))
    assert costs.verify == before and rc.rescales == 0 and rc.scale == 1.0


def test_a_sustained_drift_rescales_the_whole_table_once_per_window():
    costs = _table()
    before = dict(costs.verify)
    rc = Recalibration(costs, window=8)
    got = _feed(rc, [1.6] * 8)
    assert got[:7] == [None] * 7 and got[7] == pytest.approx(1.6)
    assert costs.verify == pytest.approx({k: 1.6 * v for k, v in before.items()})
    # relative costs of the shapes kept: v(3 rows) / v(1 row) at every batch
    assert all(costs.verify[(b, 3)] / costs.verify[(b, 1)] == pytest.approx(before[(b, 3)] / before[(b, 1)])
               for b in (1, 2, 4))
    # the window starts again: the now-right table is left alone
    assert all(f is None for f in _feed(rc, [1.6] * 16))
    assert rc.rescales == 1 and rc.scale == pytest.approx(1.6)
    # and a machine that gets faster again brings it back down (in two rescales: the window's
    # median crosses the tolerance before all of it is new)
    _feed(rc, [0.8] * 16)
    assert rc.scale == pytest.approx(0.8)
    assert costs.verify == pytest.approx({k: 0.8 * v for k, v in before.items()})


def test_outliers_do_not_move_the_median():
    costs = _table()
    rc = Recalibration(costs, window=8)
    assert all(f is None for f in _feed(rc, [1.0, 1.0, 30.0, 1.0, 1.0, 0.01, 1.0, 1.0] * 3))
    assert rc.rescales == 0


def test_the_tolerance_is_the_tables_spread_when_larger():
    noisy = Recalibration(_table(spread=0.4), window=4)
    assert noisy.tolerance == 0.4
    assert _feed(noisy, [1.3] * 4)[-1] is None  # within the start-up noise
    assert _feed(Recalibration(_table(spread=0.0), window=4), [1.3] * 4)[-1] == pytest.approx(1.3)


def test_the_network_is_not_part_of_the_drift():
    costs = _table()
    costs.network_s = 0.5  # split mode: the gateway's timing includes the round trip
    rc = Recalibration(costs, window=4)
    assert _feed(rc, [1.0] * 8) == [None] * 8


def test_a_stale_table_is_rescaled_from_the_servers_own_steps(tiny_llama, tiny_draft_close, tiny_llama_logits):
    """A colocated server with the K policy on, its verify table made 20x too cheap (as if
    calibrated on a far faster machine): its own verify calls rescale it, in the open, and the
    output is the target's (the K policy's choice never changes greedy tokens)."""
    cfg = dict(max_model_len=160, max_num_seqs=2)
    colo = build_colocated(EngineConfig(model=str(tiny_llama), **cfg), EngineConfig(model=str(tiny_draft_close), **cfg),
                           SpecConfig(num_speculative_tokens=3, k_policy="auto"), show_progress=False)
    ref = build_colocated(EngineConfig(model=str(tiny_llama), **cfg), None, SpecConfig(num_speculative_tokens=0),
                          show_progress=False)
    try:
        decoder = colo.decoder
        assert decoder.recalibration is not None and decoder.recalibration.costs is decoder.policy.costs
        costs = decoder.policy.costs
        calibrated = dict(costs.verify)
        costs.verify = {k: v / 20 for k, v in calibrated.items()}
        decoder.recalibration = Recalibration(costs, window=8)  # the default 32 calls: a longer run
        reqs = [GenerationRequest("r", (5, 6, 7, 8, 5, 6, 7, 8), 64, ignore_eos=True)]
        (state,) = Scheduler(decoder, colo.eos_token_ids, 2).run(reqs)
        (alone,) = Scheduler(ref.decoder, ref.eos_token_ids, 2).run(reqs)
        rc = decoder.recalibration
        assert rc.rescales >= 1 and rc.scale > 1 + rc.tolerance
        assert all(costs.verify[k] == pytest.approx(calibrated[k] / 20 * rc.scale) for k in calibrated)
        assert_outputs_equal_or_tie([alone.output], [state.output], [reqs[0].prompt_token_ids], tiny_llama_logits)
    finally:
        colo.close()
        ref.close()


def _draft_table(spread: float = 0.05) -> StepCosts:
    return StepCosts(verify={(1, 1): 0.01}, draft={1: 0.002, 2: 0.004, 4: 0.008}, spread=spread)


def _hybrid_calls(rc: DraftRecalibration, factor: float, n: int, share: float = 0.5, k: int = 3) -> list:
    """n just-in-time calls of one sequence from a hybrid whose model drafts k tokens on every other
    call (a lookup call ingests only: a tenth of a model call's time), priced as the K policy prices
    them (drafted = k x the model's share), on a machine `factor` times as slow as the table.
    The mix of the two kinds is the share the policy priced with, so at factor 1 the sums agree."""
    model_s = k * share * rc.costs.draft_s(1) / (share + (1 - share) * 0.1)
    out = []
    for i in range(n):
        took = model_s if i % 2 == 0 else 0.1 * model_s
        out.append(rc.observe(1, k * share, factor * took + rc.costs.network_s))
    return out


def test_a_hybrids_two_kinds_of_calls_priced_on_average_move_nothing():
    """Per call the ratios are 1.8 and 0.18 (the median would say one of them); their sums agree."""
    costs = _draft_table()
    before = dict(costs.draft)
    rc = DraftRecalibration(costs, window=8)
    assert _hybrid_calls(rc, 1.0, 40) == [None] * 40
    assert costs.draft == before and rc.rescales == 0


def test_a_drafter_slower_than_its_table_rescales_the_draft_table_only():
    costs = _draft_table()
    before_d, before_v = dict(costs.draft), dict(costs.verify)
    rc = DraftRecalibration(costs, window=8)
    got = _hybrid_calls(rc, 1.6, 8)
    assert got[:7] == [None] * 7 and got[7] == pytest.approx(1.6)
    assert costs.draft == pytest.approx({b: 1.6 * s for b, s in before_d.items()}) and costs.verify == before_v
    assert _hybrid_calls(rc, 1.0, 16) == [None] * 16  # calls as slow as the rescaled table says: left alone
    assert rc.rescales == 1 and rc.scale == pytest.approx(1.6)


def test_a_pause_in_the_drafters_window_is_left_out():
    """One call in twelve held 50x its time (a pause): it moves one run of the window only."""
    costs = _draft_table(spread=0.0)
    rc = DraftRecalibration(costs, window=12)
    base = 3 * costs.draft_s(2)
    assert [rc.observe(2, 3, (50 if i % 12 == 4 else 1) * base) for i in range(36)] == [None] * 36
    assert rc.rescales == 0
    # a drift of 1.3 (beyond the 15% floor) is seen once most runs of a window have it
    fresh = DraftRecalibration(costs, window=12)
    assert [fresh.observe(2, 3, 1.3 * base) for i in range(12)][-1] == pytest.approx(1.3)


def test_nothing_priced_nothing_measured():
    rc = DraftRecalibration(_draft_table(), window=2)
    assert [rc.observe(1, 0.0, 1.0), rc.observe(0, 2.0, 1.0)] == [None, None] and not rc._samples


def test_a_remote_drafters_stale_table_is_rescaled_from_its_own_calls(tiny_llama, tiny_draft_close, tiny_llama_logits):
    """A drafter whose calls cross the network (`remote`, as a drafter service's client says of
    itself; here the real draft engine saying it): the draft table made 20x too cheap (calibrated in
    its own process, served through a hop it never timed) is rescaled up by its own propose calls,
    the verify table is its own business, and the output is the target's. An in-process drafter's
    table is left as calibrated (recalibration.DraftRecalibration says why)."""
    cfg = dict(max_model_len=160, max_num_seqs=2)
    spec = SpecConfig(num_speculative_tokens=3, k_policy="auto")
    colo = build_colocated(EngineConfig(model=str(tiny_llama), **cfg), EngineConfig(model=str(tiny_draft_close), **cfg),
                           spec, show_progress=False)
    ref = build_colocated(EngineConfig(model=str(tiny_llama), **cfg), None, SpecConfig(num_speculative_tokens=0),
                          show_progress=False)
    try:
        assert colo.decoder.draft_recalibration is None  # in-process
        verifier, drafter = colo.decoder.verifier, colo.decoder.drafter
        drafter.remote = True
        decoder = colocated_decoder(verifier, drafter, spec, 160)
        rc = decoder.draft_recalibration
        assert rc is not None and rc.costs is decoder.policy.costs and rc.costs.draft
        costs = rc.costs
        calibrated, verify = dict(costs.draft), dict(costs.verify)
        costs.draft = {b: s / 20 for b, s in calibrated.items()}
        decoder.draft_recalibration = rc = DraftRecalibration(costs, window=8)
        decoder.recalibration = None  # the verify table's own drift is another test's
        reqs = [GenerationRequest("r", (5, 6, 7, 8, 5, 6, 7, 8), 64, ignore_eos=True)]
        (state,) = Scheduler(decoder, colo.eos_token_ids, 2).run(reqs)
        (alone,) = Scheduler(ref.decoder, ref.eos_token_ids, 2).run(reqs)
        assert rc.rescales >= 1 and rc.scale > 1 + rc.tolerance
        assert all(costs.draft[b] == pytest.approx(calibrated[b] / 20 * rc.scale) for b in calibrated)
        assert costs.verify == verify
        assert_outputs_equal_or_tie([alone.output], [state.output], [reqs[0].prompt_token_ids], tiny_llama_logits)
    finally:
        colo.close()
        ref.close()


def test_no_policy_no_recalibration(tiny_llama, tiny_draft_close):
    cfg = dict(max_model_len=160, max_num_seqs=2)
    colo = build_colocated(EngineConfig(model=str(tiny_llama), **cfg), EngineConfig(model=str(tiny_draft_close), **cfg),
                           SpecConfig(num_speculative_tokens=3, k_policy="fixed"), show_progress=False)
    try:
        assert colo.decoder.policy is None and colo.decoder.recalibration is None
        assert colo.decoder.draft_recalibration is None
    finally:
        colo.close()
