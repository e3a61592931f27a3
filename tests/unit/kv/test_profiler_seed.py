"""The seed bug in miniature: a KV cache sized as if the draft's weights were not there.

vLLM once sized the target's cache from a profile that left out the draft model's weights and then
ran out of memory allocating it. Here the budget would hold the target's cache exactly if the
draft (16 MiB of weights, little KV per token) were ignored; colocated mode must take both models'
weights and peaks off the one budget first, size smaller caches, and a full run (profile, then a
batch at max_num_seqs) must stay within the budget, measured, not computed.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from specsplit.config import SpecConfig
from specsplit.factory import plan_memory
from tests.unit.kv.conftest import MiB, engine_cfg

REPO = Path(__file__).resolve().parents[3]

SPEC = SpecConfig(num_speculative_tokens=3)
BUDGET = 96 * MiB


def _cfgs(kv_target, heavy_draft):
    t = engine_cfg(kv_target, memory_budget_bytes=BUDGET, max_model_len=128, max_num_seqs=4, kv_cap=False)
    d = engine_cfg(heavy_draft, max_model_len=128, max_num_seqs=4, kv_cap=False)
    return t, d


def test_colocated_counts_the_draft_weights(warm, kv_target, heavy_draft):
    t, d = _cfgs(kv_target, heavy_draft)
    alone = plan_memory(t, None, SPEC).services["verifier"]  # what a draft-blind profile would size
    joint = plan_memory(t, d, SPEC, colocated=True)
    v, dr = joint.services["verifier"], joint.services["drafter"]
    assert joint.joint and joint.budget_bytes == BUDGET
    assert dr.weights_bytes > 15 * MiB
    # The draft-blind cache fits the budget only without the draft: with it, it would not.
    assert alone.weights_bytes + alone.activation_peak_bytes + alone.kv_cache_bytes + dr.weights_bytes > BUDGET
    # Colocated: both models' weights and peaks came off first, so both caches are smaller ...
    assert v.num_blocks < alone.num_blocks
    assert v.kv_cache_bytes <= alone.kv_cache_bytes - dr.weights_bytes + 2 * MiB
    # ... they hold the same tokens, and everything fits in the one budget.
    assert v.max_tokens == dr.max_tokens
    assert v.used_bytes + dr.used_bytes <= BUDGET
    assert v.budget_bytes + dr.budget_bytes == BUDGET


def test_full_run_stays_within_the_budget(tiny_llama, tiny_draft_far, kv_target, heavy_draft):
    """Measured in a process of its own (tests/unit/kv/full_run.py): peak RSS growth counts the
    whole process, so in the suite's it would depend on the tests that ran before."""
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", "tests.unit.kv.full_run", str(tiny_llama), str(tiny_draft_far),
                           str(kv_target), str(heavy_draft), str(BUDGET)],
                          capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["kv_matches_plan"] and r["outputs"] == [20] * 4
    # Torch alone: the run's transient peak is within what the profile measured for both steps.
    assert r["torch_peak"] <= r["profiled_peaks"]
    # The process as a whole (weights, caches, activations, everything else) stayed in the budget.
    peak = r["peak_rss_growth"]
    assert peak <= BUDGET, f"peak RSS growth {peak / MiB:.1f} MiB > budget {BUDGET / MiB:.1f} MiB; plan {r['plan']}"
