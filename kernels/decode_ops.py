"""Host side of kernels/cpu/decode_ops.cpp: the per-layer glue of a CPU decode or verify step in
fp32 (RMSNorm, rotary embedding, attention over the paged KV cache), one call each instead of a few
dozen torch ops per layer (about 7 ms of SmolLM2-135M's 19 ms step on a Zen 4 core was those ops).

Same functions as the torch path within fp32 summation order (tests/unit/kernels/test_decode_ops.py
compares them). `load()` returns None where the extension cannot be had (no AVX2/FMA, no compiler,
a failed build, or SPECSPLIT_DECODE_OPS=0); the model then runs its torch ops as before.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

from specsplit.kernels.cpu_build import build, cpu_has

SOURCE = Path(__file__).resolve().parent / "cpu" / "decode_ops.cpp"
ENV_SWITCH = "SPECSPLIT_DECODE_OPS"  # "0": never build or use them
# -ffp-contract=off as in kernels/quant_linear.py: rope's x * cos + x' * sin stays two roundings
# (torch's), and kernels/layer_stack.py, which compiles this file beside quant_linear.cpp with
# those flags, gets the same bits as this extension.
CFLAGS = ["-O3", "-mavx2", "-mfma", "-ffp-contract=off"]


@functools.lru_cache(maxsize=1)
def load():
    """The compiled extension, or None (logged once) where it cannot be had."""
    if os.environ.get(ENV_SWITCH, "1") == "0" or not cpu_has("avx2", "fma"):
        return None
    return build("specsplit_decode_ops", SOURCE, CFLAGS, "CPU decode ops", "norms, rope and attention run as torch ops")


def usable(x: torch.Tensor) -> bool:
    """Whether the ops take this activation: fp32 on the CPU, with the extension built."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and load() is not None
