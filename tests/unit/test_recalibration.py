"""Re-calibration while serving (specsplit/recalibration.py): the verify table follows a drift of
the live verify calls beyond its noise, never one slow step, and keeps the shapes' relative costs;
a colocated server whose table is stale rescales it from its own steps, output unchanged."""
from __future__ import annotations

import pytest

from specsplit.calibration import StepCosts
from specsplit.config import EngineConfig, SpecConfig
from specsplit.factory import build_colocated
from specsplit.recalibration import Recalibration
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


def test_no_policy_no_recalibration(tiny_llama, tiny_draft_close):
    cfg = dict(max_model_len=160, max_num_seqs=2)
    colo = build_colocated(EngineConfig(model=str(tiny_llama), **cfg), EngineConfig(model=str(tiny_draft_close), **cfg),
                           SpecConfig(num_speculative_tokens=3, k_policy="fixed"), show_progress=False)
    try:
        assert colo.decoder.policy is None and colo.decoder.recalibration is None
    finally:
        colo.close()
