"""specsplit.kernels.dispatch: one place decides torch vs triton; SPECSPLIT_KERNELS forces either."""

import pytest
import torch

from specsplit.kernels import dispatch


def test_auto_uses_torch_on_cpu(monkeypatch):
    monkeypatch.delenv("SPECSPLIT_KERNELS", raising=False)
    assert dispatch.use_triton(torch.device("cpu")) is False
    assert dispatch.backend_name("cpu") == "torch"


def test_auto_uses_triton_on_cuda(monkeypatch):
    monkeypatch.delenv("SPECSPLIT_KERNELS", raising=False)
    assert dispatch.use_triton("cuda") == (dispatch.triton_import_error() is None)


def test_force_torch(monkeypatch):
    monkeypatch.setenv("SPECSPLIT_KERNELS", "torch")
    assert dispatch.use_triton("cuda") is False and dispatch.use_triton("cpu") is False


def test_force_triton_on_cpu_needs_interpreter(monkeypatch):
    monkeypatch.setenv("SPECSPLIT_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        dispatch.use_triton("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert dispatch.use_triton("cpu") is True


def test_bad_value(monkeypatch):
    monkeypatch.setenv("SPECSPLIT_KERNELS", "cuda")
    with pytest.raises(ValueError, match="SPECSPLIT_KERNELS"):
        dispatch.use_triton("cpu")


def test_missing_triton_is_reported(monkeypatch):
    monkeypatch.setenv("SPECSPLIT_KERNELS", "triton")
    monkeypatch.setattr(
        dispatch, "triton_import_error", lambda: "ImportError: no module named triton"
    )
    with pytest.raises(RuntimeError, match="cannot be imported"):
        dispatch.use_triton("cuda")


def _spy(monkeypatch, module, name):
    calls = []
    original = getattr(module, name)

    def spy(*args, **kwargs):
        calls.append(name)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return calls


def test_routes_every_op(monkeypatch, force_triton, device, load_kernel):
    greedy = load_kernel("rejection_greedy")
    rand = load_kernel("rejection_random")
    kv = load_kernel("kv_store")
    calls = _spy(monkeypatch, greedy, "greedy_rejection_triton")
    calls_a = _spy(monkeypatch, rand, "random_accept_triton")
    calls_f = _spy(monkeypatch, rand, "random_finish_triton")
    calls_s = _spy(monkeypatch, kv, "store_kv_triton")

    target = torch.tensor([[1, 2, 3]], device=device)
    n, out = dispatch.greedy_rejection(
        torch.tensor([[1, 5]], device=device), torch.tensor([2], device=device), target
    )
    assert n.tolist() == [1] and out.tolist() == [[1, 2, -1]]
    p = torch.full((1, 3, 4), 0.25, device=device)
    u = torch.zeros(1, 2, dtype=torch.float64, device=device)
    assert dispatch.random_accept(
        torch.tensor([[0, 1]], device=device),
        torch.full((1, 2), 0.25, device=device),
        torch.tensor([2], device=device),
        p,
        u,
    ).tolist() == [2]
    assert dispatch.random_finish(
        p[:, 2], [None], torch.tensor([0.99], dtype=torch.float64, device=device)
    ).tolist() == [3]
    cache = torch.zeros(1, 2, 1, 4, device=device)
    dispatch.store_kv(
        torch.ones(1, 1, 4, device=device),
        torch.ones(1, 1, 4, device=device),
        cache,
        cache.clone(),
        torch.tensor([1], device=device),
    )
    assert cache[0, 1].sum() == 4 and cache[0, 0].sum() == 0
    assert calls and calls_a and calls_f and calls_s

    monkeypatch.setenv("SPECSPLIT_KERNELS", "torch")
    dispatch.greedy_rejection(
        torch.tensor([[1, 5]], device=device), torch.tensor([2], device=device), target
    )
    assert len(calls) == 1
