"""Every service profiles itself at start-up and logs its plan; the numbers are measured and used."""
from __future__ import annotations

import logging

import pytest

from specsplit.config import SpecConfig
from specsplit.engine import DraftEngine, NgramDrafter, TargetEngine
from specsplit.factory import build_colocated, build_draft_engine, build_target_engine, plan_memory
from specsplit.models.bounded_runner import BoundedRunner
from specsplit.kv.profiler import MemoryBudgetError, fmt_bytes
from tests.unit.kv.conftest import MiB, engine_cfg

SPEC = SpecConfig(num_speculative_tokens=3)


def _plan_lines(caplog):
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("memory plan [")]


def test_split_services_each_profile_and_log_their_own_plan(warm, kv_target, heavy_draft, caplog):
    caplog.set_level(logging.INFO, logger="specsplit.kv.profiler")
    engine, plan = build_target_engine(engine_cfg(kv_target, memory_budget_bytes=64 * MiB), SPEC)
    assert isinstance(engine, TargetEngine) and isinstance(engine.runner, BoundedRunner)
    v = plan.services["verifier"]
    assert not plan.joint and set(plan.services) == {"verifier"} and v.budget_bytes == 64 * MiB
    assert engine.block_manager.num_blocks == v.num_blocks and engine.runner.kv.nbytes == v.kv_cache_bytes
    assert v.weights_bytes > 0 and v.activation_peak_bytes > 0

    drafter, dplan = build_draft_engine(engine_cfg(heavy_draft, memory_budget_bytes=48 * MiB), SPEC, vocab_size=256)
    assert isinstance(drafter, DraftEngine) and dplan.services["drafter"].weights_bytes > 15 * MiB

    ngram, nplan = build_draft_engine(engine_cfg("ngram"), SPEC)
    assert isinstance(ngram, NgramDrafter)
    assert nplan.to_dict()["services"]["drafter"]["weights_bytes"] == 0
    assert all(nplan.to_dict()["services"]["drafter"][k] == 0 for k in ("kv_cache_bytes", "num_blocks", "max_tokens"))

    lines = _plan_lines(caplog)
    assert len(lines) == 3
    assert "[verifier]" in lines[0] and "budget 64.00 MiB" in lines[0]
    for word in ("weights", "activation peak", "non-torch", "KV cache", "blocks", "tokens"):
        assert word in lines[0]
    assert "[drafter]" in lines[1] and "[drafter] ngram" in lines[2]


def test_colocated_logs_one_line_per_service_with_both_weights(warm, kv_target, heavy_draft, caplog):
    caplog.set_level(logging.INFO, logger="specsplit.kv.profiler")
    colo = build_colocated(engine_cfg(kv_target, memory_budget_bytes=96 * MiB), engine_cfg(heavy_draft), SPEC,
                           show_progress=False)
    lines = _plan_lines(caplog)
    assert len(lines) == 2 and "[verifier]" in lines[0] and "[drafter]" in lines[1]
    w_t = colo.plan.services["verifier"].weights_bytes
    w_d = colo.plan.services["drafter"].weights_bytes
    for line in lines:
        assert "joint budget 96.00 MiB" in line and f"weights target {fmt_bytes(w_t)} + draft {fmt_bytes(w_d)}" in line
    assert colo.plan.to_dict()["joint"] is True
    colo.close()


def test_the_cache_uses_the_budget(warm, kv_target, heavy_draft):
    """After sizing, KV bytes >= 90% of (budget - weights - peak - non-torch), split and joint."""
    t = engine_cfg(kv_target, memory_budget_bytes=80 * MiB, kv_cap=False)
    for plan in (plan_memory(t, None, SPEC), plan_memory(t, engine_cfg(heavy_draft, kv_cap=False), SPEC, colocated=True)):
        services = plan.services.values()
        fixed = sum(s.weights_bytes + s.activation_peak_bytes + s.non_torch_bytes for s in services)
        left = plan.budget_bytes - fixed
        kv = sum(s.kv_cache_bytes for s in services)
        assert 0.9 * left <= kv <= left, plan.to_dict()
        assert all(s.kv_limited_by == "budget" for s in services)
    # With the default cap the cache stops at what max_num_seqs sequences can fill.
    capped = plan_memory(engine_cfg(kv_target, memory_budget_bytes=80 * MiB), None, SPEC).services["verifier"]
    assert capped.kv_limited_by == "max_num_seqs" and capped.max_tokens == 4 * 128


def test_activation_peak_is_measured_at_the_largest_batch(warm, kv_target):
    """16 sequences' verify step holds at least 14 more sequences' (K+1)-row fp32 logits than 2
    sequences' does (the rest of the peak, e.g. a prefill chunk, is the same for both; since the
    CPU attention reads the cache in place there are no per-sequence K/V gathers to add more)."""
    import json

    small = plan_memory(engine_cfg(kv_target, memory_budget_bytes=64 * MiB, max_num_seqs=2), None, SPEC)
    big = plan_memory(engine_cfg(kv_target, memory_budget_bytes=64 * MiB, max_num_seqs=16, max_model_len=256), None, SPEC)
    vocab = json.loads((kv_target / "config.json").read_text())["vocab_size"]
    logits = (16 - 2) * (SPEC.num_speculative_tokens + 1) * vocab * 4
    assert big.services["verifier"].activation_peak_bytes - small.services["verifier"].activation_peak_bytes >= logits


def test_refuses_before_allocating_a_cache(warm, kv_target, heavy_draft):
    with pytest.raises(MemoryBudgetError, match="cannot hold the weights"):
        build_colocated(engine_cfg(kv_target, memory_budget_bytes=8 * MiB), engine_cfg(heavy_draft), SPEC, show_progress=False)
    with pytest.raises(MemoryBudgetError, match="--max-model-len 512"):
        plan_memory(engine_cfg(kv_target, memory_budget_bytes=2 * MiB, max_model_len=512), None, SPEC)
