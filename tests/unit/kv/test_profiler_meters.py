"""The measuring instruments: exact live-tensor bytes on CPU, and weights measured, not computed."""
from __future__ import annotations

import pytest
import torch
import torch.autograd.profiler as autograd_profiler

from specsplit.config import EngineConfig
from specsplit.engine_build import load_for
from specsplit.kv.meters import TorchMeter, device_memory, peak_rss_bytes, reset_peak_rss, rss_bytes, tensor_storage_bytes
from specsplit.kv.profiler import MemoryProfiler


def _work():
    a = torch.empty(1_000_000, dtype=torch.float32)  # 4 MB
    b = torch.empty(500_000, dtype=torch.float64)  # 4 MB
    del a
    c = torch.ones(250_000, dtype=torch.int32)  # 1 MB, reuses nothing
    return b, c


@pytest.mark.parametrize("method", ["storages", "allocator"])
def test_live_bytes_are_exact(method):
    with TorchMeter("cpu", method=method) as m:
        kept = _work()
    assert m.net == 4_000_000 + 1_000_000
    assert m.peak == 8_000_000  # a and b were live together
    del kept
    w = torch.randn(256, 256)
    with TorchMeter("cpu", method=method) as m2:
        v = w.t()[:10].unsqueeze(0)  # views and in-place results allocate nothing
        w.add_(1)
        x = w @ w  # a temporary, counted and then freed
        del x, v
    assert m2.net == 0 and m2.peak >= 256 * 256 * 4


def test_allocator_method_falls_back_under_a_running_profiler():
    with autograd_profiler.profile(use_kineto=False):
        with TorchMeter("cpu", method="allocator") as m:
            kept = _work()
    assert m.method.startswith("tensor storages")
    assert m.net == 5_000_000 and m.peak == 8_000_000
    del kept


def test_weights_are_the_bytes_the_load_left_live(tiny_llama, tiny_qwen2):
    for path in (tiny_llama, tiny_qwen2):  # untied and tied embeddings
        cfg = EngineConfig(model=str(path), max_model_len=128)
        prof = MemoryProfiler("cpu", budget_bytes=1 << 30)
        loaded = prof.load("verifier", lambda: load_for(cfg, False))
        held = tensor_storage_bytes(loaded.model)
        params = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
        assert abs(prof.measured["verifier"].weights - held) <= 0.01 * held
        assert held >= params


def test_device_memory_and_rss():
    total, free = device_memory(torch.device("cpu"))
    assert 0 < free <= total
    assert reset_peak_rss()
    before = rss_bytes()
    x = torch.ones(8_000_000, dtype=torch.uint8)  # touched: resident
    assert peak_rss_bytes() >= before + 7_000_000
    del x
