"""Sizing from measured numbers: one budget or two, equal tokens, the budget used, refusals with numbers."""
from __future__ import annotations

import json

import pytest
import torch

from specsplit.kv.profiler import KVShape, MemoryBudgetError, MemoryPlan, MemoryProfiler, ServicePlan

MiB = 1 << 20
SERVICE_KEYS = {"weights_bytes", "activation_peak_bytes", "non_torch_bytes", "kv_cache_bytes", "num_blocks",
                "block_size", "max_tokens", "budget_bytes"}


def shape(per_token: int, block_size=16, max_model_len=1024, max_num_seqs=64, **kw) -> KVShape:
    return KVShape(block_size, per_token * block_size, max_model_len, max_num_seqs, **kw)


def plan_of(budget, measured: dict, shapes: dict) -> MemoryPlan:
    prof = MemoryProfiler("cpu", budget_bytes=budget)
    prof.free_at_start = 1 << 50  # sizing only: pretend the host has the room
    for s, (w, a, nt) in measured.items():
        prof.record(s, w, a, nt)
    return prof.plan(shapes, models={s: s for s in shapes}, dtypes={s: torch.float32 for s in shapes})


def test_single_service_uses_the_budget():
    plan = plan_of(256 * MiB, {"verifier": (40 * MiB, 10 * MiB, 3 * MiB)}, {"verifier": shape(4096)})
    v = plan.services["verifier"]
    left = 256 * MiB - 40 * MiB - 10 * MiB - 3 * MiB
    assert v.kv_cache_bytes <= left and v.kv_cache_bytes >= 0.9 * left
    assert left - v.kv_cache_bytes < v.kv_bytes_per_block  # whole blocks, less than one wasted
    assert v.max_tokens == v.num_blocks * 16 and v.kv_limited_by == "budget"
    assert v.budget_bytes == plan.budget_bytes == 256 * MiB and not plan.joint


def test_joint_budget_counts_both_models_and_gives_both_caches_the_same_tokens():
    budget = 256 * MiB
    measured = {"verifier": (40 * MiB, 10 * MiB, 3 * MiB), "drafter": (30 * MiB, 6 * MiB, 1 * MiB)}
    plan = plan_of(budget, measured, {"verifier": shape(4096), "drafter": shape(1024)})
    v, d = plan.services["verifier"], plan.services["drafter"]
    alone = plan_of(budget, {"verifier": measured["verifier"]}, {"verifier": shape(4096)}).services["verifier"]
    assert plan.joint and v.max_tokens == d.max_tokens and v.num_blocks == d.num_blocks
    assert v.kv_cache_bytes < alone.kv_cache_bytes - 30 * MiB  # the draft's weights came off first
    left = budget - sum(sum(x) for x in measured.values())
    kv = v.kv_cache_bytes + d.kv_cache_bytes
    assert 0.9 * left <= kv <= left
    assert v.used_bytes + d.used_bytes <= budget
    assert v.budget_bytes + d.budget_bytes == budget  # shares of the one budget
    assert d.kv_cache_bytes * 4 == v.kv_cache_bytes  # same tokens, a quarter of the bytes per token


def test_cache_is_capped_at_what_the_scheduler_can_fill():
    plan = plan_of(1 << 30, {"verifier": (MiB, MiB, 0)}, {"verifier": shape(4096, max_model_len=256, max_num_seqs=4)})
    v = plan.services["verifier"]
    assert v.kv_limited_by == "max_num_seqs" and v.num_blocks == 4 * 16 and v.max_tokens == 4 * 256
    assert v.kv_available_bytes > v.kv_cache_bytes
    uncapped = plan_of(1 << 30, {"verifier": (MiB, MiB, 0)},
                       {"verifier": shape(4096, max_model_len=256, max_num_seqs=4, cap=False)}).services["verifier"]
    assert uncapped.kv_limited_by == "budget" and uncapped.kv_cache_bytes >= 0.9 * uncapped.kv_available_bytes


def test_num_blocks_override_is_used_and_checked():
    v = plan_of(64 * MiB, {"verifier": (MiB, MiB, 0)}, {"verifier": shape(1024, num_blocks_override=100)}).services["verifier"]
    assert v.num_blocks == 100 and v.kv_limited_by == "num_blocks"
    with pytest.raises(MemoryBudgetError, match="--num-blocks"):
        plan_of(8 * MiB, {"verifier": (MiB, MiB, 0)}, {"verifier": shape(1024, num_blocks_override=1000)})


def test_num_blocks_below_one_sequence_names_num_blocks_not_the_budget():
    """A budget with room to spare, but --num-blocks fixes a cache smaller than one --max-model-len
    sequence: the error names the flags that set it (it read as a budget problem)."""
    with pytest.raises(MemoryBudgetError) as e:
        plan_of(1 << 30, {"verifier": (MiB, MiB, 0)}, {"verifier": shape(1024, max_model_len=512, num_blocks_override=24)})
    msg = str(e.value)
    assert msg.startswith("--num-blocks 24 x --block-size 16 = 384 tokens") and "at least 32" in msg, msg
    assert "Raise --memory-budget" not in msg


def test_refuses_a_budget_below_the_weights_naming_both_models():
    prof = MemoryProfiler("cpu", budget_bytes=50 * MiB)
    prof.record("verifier", weights=30 * MiB)
    with pytest.raises(MemoryBudgetError) as e:
        prof.record("drafter", weights=25 * MiB)
    msg = str(e.value)
    assert "50.00 MiB" in msg and "verifier 30.00 MiB" in msg and "drafter 25.00 MiB" in msg and "55.00 MiB" in msg


def test_refuses_a_budget_that_cannot_hold_max_model_len():
    with pytest.raises(MemoryBudgetError) as e:
        plan_of(64 * MiB, {"verifier": (40 * MiB, 20 * MiB, 3 * MiB)}, {"verifier": shape(4096, max_model_len=4096)})
    msg = str(e.value)
    for part in ("64.00 MiB", "weights 40.00 MiB", "activation peak 20.00 MiB", "non-torch 3.00 MiB",
                 "--max-model-len 4096", "16.00 MiB"):
        assert part in msg, (part, msg)


def test_refuses_a_plan_larger_than_the_free_memory_at_start():
    prof = MemoryProfiler("cpu", budget_bytes=256 * MiB)
    prof.free_at_start = 100 * MiB
    prof.record("verifier", 40 * MiB, 10 * MiB, 0)
    with pytest.raises(MemoryBudgetError, match="was free at start-up"):
        prof.plan({"verifier": shape(4096, cap=False)}, {"verifier": "m"}, {"verifier": torch.float32})


def test_plan_format_round_trips():
    measured = {"verifier": (40 * MiB, 10 * MiB, 3 * MiB), "drafter": (30 * MiB, 6 * MiB, 1 * MiB)}
    plan = plan_of(256 * MiB, measured, {"verifier": shape(4096), "drafter": shape(1024)})
    d = json.loads(plan.to_json())
    assert d["joint"] is True and d["budget_bytes"] == 256 * MiB
    assert set(d["services"]) == {"verifier", "drafter"}
    for s in d["services"].values():
        assert SERVICE_KEYS <= set(s) and all(isinstance(s[k], int) for k in SERVICE_KEYS)
    assert MemoryPlan.from_dict(d).to_dict() == plan.to_dict()
    split = MemoryPlan.merge([
        plan_of(100 * MiB, {"verifier": measured["verifier"]}, {"verifier": shape(4096)}),
        MemoryPlan(False, 0, {"drafter": ServicePlan.zeros("drafter", "ngram")}),
    ])
    sd = split.to_dict()
    assert sd["joint"] is False and sd["budget_bytes"] == 100 * MiB
    assert all(sd["services"]["drafter"][k] == 0 for k in SERVICE_KEYS)
    lines = plan.log_lines()
    assert len(lines) == 2 and all("weights target 40.00 MiB + draft 30.00 MiB" in l for l in lines)
    assert "KV cache" in lines[0] and "blocks" in lines[0] and "tokens" in lines[0]
