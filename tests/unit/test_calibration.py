"""Start-up calibration (specsplit/calibration.py): interleaved repeated timings, a robust
estimate, and a table that is non-decreasing in rows and in batch whatever the samples said."""
from __future__ import annotations

import random

import pytest

from specsplit.calibration import CONTEXT_TOKENS, StepCosts, calibrate_drafter, calibrate_verifier, isotonic, monotone_fit
from specsplit.config import EngineConfig
from specsplit.engine_build import load_for, make_runner


def test_isotonic_is_the_least_squares_monotone_fit():
    assert isotonic([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
    assert isotonic([1.0, 3.0, 2.0, 4.0]) == [1.0, 2.5, 2.5, 4.0]
    assert isotonic([3.0, 2.0, 1.0]) == [2.0, 2.0, 2.0]
    assert isotonic([]) == []


@pytest.mark.parametrize("seed", range(20))
def test_monotone_fit_is_monotone_in_rows_and_batch(seed):
    rng = random.Random(seed)
    batches, rows = [1, 2, 4, 8, 16, 32], [1, 2, 3, 4]
    # a true cost growing in both, observed with +-60% noise (what this VM has shown)
    noisy = {(b, r): (0.02 + 0.004 * b * r) * rng.uniform(0.4, 1.6) for b in batches for r in rows}
    fit = monotone_fit(noisy)
    for b in batches:
        for r1, r2 in zip(rows, rows[1:]):
            assert fit[(b, r1)] <= fit[(b, r2)] + 1e-12
    for r in rows:
        for b1, b2 in zip(batches, batches[1:]):
            assert fit[(b1, r)] <= fit[(b2, r)] + 1e-12
    # a fit moves values only within the range the samples span
    assert min(noisy.values()) - 1e-12 <= min(fit.values()) and max(fit.values()) <= max(noisy.values()) + 1e-12


def test_calibrated_tables_are_monotone_and_leave_nothing_allocated(tiny_llama):
    cfg = EngineConfig(model=str(tiny_llama), max_model_len=CONTEXT_TOKENS + 16, max_num_seqs=8)
    runner = make_runner(load_for(cfg, show_progress=False), cfg, num_blocks=64, num_speculative_tokens=3)
    free = runner.block_manager.num_free_blocks
    v = calibrate_verifier(runner, 3, 8, rounds=3)
    d = calibrate_drafter(runner, 8, rounds=3)
    assert runner.block_manager.num_free_blocks == free
    assert sorted({b for b, _ in v.verify}) == [1, 2, 4, 8] and sorted({r for _, r in v.verify}) == [1, 2, 3, 4]
    for (b, r), s in v.verify.items():
        assert s > 0
        if (b, r + 1) in v.verify:
            assert s <= v.verify[(b, r + 1)]
        if (2 * b, r) in v.verify:
            assert s <= v.verify[(2 * b, r)]
    ds = [d.draft[b] for b in sorted(d.draft)]
    assert ds == sorted(ds) and v.spread >= 0.0


def test_step_costs_read_back_from_the_wire_rows():
    """from_rows is as_rows read back (GetInfo's and GetServerInfo's StepCost messages)."""
    from specsplit.v1 import common_pb2

    costs = StepCosts(verify={(1, 1): 0.008, (1, 2): 0.01, (2, 1): 0.011}, draft={1: 0.0005, 2: 0.001})
    wire = {kind: [common_pb2.StepCost(batch=b, rows=r, seconds=t) for b, r, t in costs.as_rows(kind)]
            for kind in ("verify", "draft")}
    back = StepCosts.from_rows(wire["verify"], wire["draft"], 0.0007)
    assert back.verify == pytest.approx(costs.verify) and back.draft == pytest.approx(costs.draft)
    assert back.network_s == 0.0007 and StepCosts.from_rows(wire["verify"]).draft == {}
