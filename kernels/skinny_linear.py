"""Host side of kernels/cpu/skinny_linear.cpp: a CPU fp32 linear for a few rows (decode and
verification) that reads each weight element once, so verifying k+1 tokens costs about one
decode step on AVX2 CPUs too (see the .cpp for the layout and the numbers).

The extension is compiled on first use with torch's cpp_extension (gcc and ninja; about 25 s once,
then loaded from torch's extension cache). `load()` returns None where it cannot be had: no
AVX2/FMA, no compiler, a failed build, or SPECSPLIT_SKINNY=0; callers then use the other kernels.
The torch reference is `F.linear`; tests compare the two.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path

import torch
import torch.nn.functional as F

from specsplit.kernels.cpu_build import build, cpu_has


SOURCE = Path(__file__).resolve().parent / "cpu" / "skinny_linear.cpp"
ENV_SWITCH = "SPECSPLIT_SKINNY"  # "0": never build or use it
_lock = threading.Lock()
_module = None
_tried = False


def cpu_supports() -> bool:
    """AVX2 and FMA on this CPU."""
    return cpu_has("avx2", "fma")


def load():
    """The compiled extension, or None (logged once) where it cannot be had."""
    global _module, _tried
    with _lock:
        if _tried:
            return _module
        _tried = True
        if os.environ.get(ENV_SWITCH, "1") == "0" or not cpu_supports():
            return None
        _module = build("specsplit_skinny_linear", SOURCE, ["-O3", "-mavx2", "-mfma"], "skinny linear kernel",
                        "using MKL/oneDNN for few-row calls")
        return _module


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] fp32 -> [ceil(N/16), K, 16], the layout `linear` reads."""
    return load().skinny_pack(weight.detach().contiguous())


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] fp32 -> [M, out_features]; equal to `reference` within fp32 summation order."""
    return load().skinny_linear(x, packed, out_features, bias)


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)
