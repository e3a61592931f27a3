"""Fixtures for the memory profiler tests: checkpoints whose sizes make the budget arithmetic bite,
and a warm-up so one-time costs of a process's first profile run (libraries imported and paged in
on first use) are paid before the tests that compare plans."""
from __future__ import annotations

import pytest

from specsplit.config import EngineConfig, SpecConfig
from tests.helpers.tiny_models import write_tiny_model

MiB = 1 << 20


@pytest.fixture(autouse=True)
def _dense_kernels(monkeypatch):
    """The budget arithmetic here is sized for one dense copy of each weight, and the RSS checks
    for torch's allocator alone: oneDNN's packed kernels keep primitives and scratchpads the
    profile does not measure yet (specsplit/models/cpu_linear.py). Tests that check packed bytes
    set the policy themselves (test_profiler_smollm.py)."""
    monkeypatch.setenv("SPECSPLIT_LINEAR_KERNEL", "dense")


def engine_cfg(model, **kw) -> EngineConfig:
    base = dict(model=str(model), max_model_len=128, max_num_seqs=4, max_prefill_tokens=32, block_size=16)
    base.update(kw)
    return EngineConfig(**base)


@pytest.fixture(scope="session")
def kv_target(tmp_path_factory):
    """A target whose KV is large per token (4 layers x 4 KV heads x 16 = 2 KiB/token fp32), small weights."""
    return write_tiny_model(tmp_path_factory.mktemp("kv-target"), "llama", seed=3, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=4)


@pytest.fixture(scope="session")
def heavy_draft(tmp_path_factory):
    """A draft with the opposite shape: ~16 MiB of weights, 512 B/token of KV (1 layer, 1 KV head of 64)."""
    return write_tiny_model(tmp_path_factory.mktemp("heavy-draft"), "llama", seed=4, hidden_size=512,
                            intermediate_size=2048, num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=1)


@pytest.fixture(scope="session")
def warm(tiny_llama, tiny_draft_far):
    """Run one colocated plan so later measurements in this process are not a first run's."""
    from specsplit.factory import build_colocated

    cfg = engine_cfg(tiny_llama, memory_budget_bytes=1 << 30)
    with pytest.MonkeyPatch.context() as mp:  # session-scoped: built before _dense_kernels applies
        mp.setenv("SPECSPLIT_LINEAR_KERNEL", "dense")
        build_colocated(cfg, engine_cfg(tiny_draft_far), SpecConfig(num_speculative_tokens=3), show_progress=False).close()
    return True
