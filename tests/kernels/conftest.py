"""Kernel tests run the Triton kernels on CUDA when there is a GPU, else in Triton's interpreter.

TRITON_INTERPRET is read when a kernel is decorated (at import of its module), so it is set here,
before any kernel module is imported; `load_kernel` re-imports a module that some earlier test
imported without it.
"""

import gc
import importlib
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"


def _triton_error():
    try:
        import triton  # noqa: F401
    except Exception as exc:  # pragma: no cover - depends on the install
        return f"{type(exc).__name__}: {exc}"
    return None


def kernel_module(name: str):
    """Import specsplit.kernels.<name>, re-importing it if its kernels were built for the wrong mode."""
    error = _triton_error()
    if error:
        pytest.skip(f"triton does not import: {error}")
    module = importlib.import_module(f"specsplit.kernels.{name}")
    if not HAS_CUDA:
        from triton.runtime.interpreter import InterpretedFunction

        kernels = [
            v for k, v in vars(module).items() if k.startswith("_") and k.endswith("_kernel")
        ]
        if kernels and not all(isinstance(k, InterpretedFunction) for k in kernels):
            module = importlib.reload(module)
    return module


@pytest.fixture(scope="session")
def load_kernel():
    """The kernel_module loader, as a fixture (test modules do not import conftest)."""
    return kernel_module


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture
def force_triton(monkeypatch):
    """Route specsplit.kernels.dispatch to the Triton path for this test."""
    monkeypatch.setenv("SPECSPLIT_KERNELS", "triton")
    if not HAS_CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _collect_garbage():  # overrides tests/conftest.py's per-test gc.collect() (~0.4 s each)
    yield


@pytest.fixture(autouse=True, scope="module")
def _collect_garbage_per_module():
    yield
    gc.collect()
