"""Host side of kernels/cpu/skinny_linear.cpp: a CPU fp32 linear for a few rows (decode and
verification) that reads each weight element once, so verifying k+1 tokens costs about one
decode step on AVX2 CPUs too (see the .cpp for the layout and the numbers).

The extension is compiled on first use with torch's cpp_extension (gcc and ninja; about 25 s once,
then loaded from torch's extension cache). `load()` returns None where it cannot be had: no
AVX2/FMA, no compiler, a failed build, or SPECSPLIT_SKINNY=0; callers then use the other kernels.
The torch reference is `F.linear`; tests compare the two.
"""
from __future__ import annotations

import logging
import os
import shutil
import sys
import threading
from pathlib import Path

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "cpu" / "skinny_linear.cpp"
ENV_SWITCH = "SPECSPLIT_SKINNY"  # "0": never build or use it
_lock = threading.Lock()
_module = None
_tried = False


def cpu_supports() -> bool:
    """AVX2 and FMA on this CPU (x86 Linux: /proc/cpuinfo)."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return False
    words = set(flags.split())
    return {"avx2", "fma"} <= words


def load():
    """The compiled extension, or None (logged once) where it cannot be had."""
    global _module, _tried
    with _lock:
        if _tried:
            return _module
        _tried = True
        if os.environ.get(ENV_SWITCH, "1") == "0" or not cpu_supports():
            return None
        # torch runs `ninja`; the one pip installs into this environment sits beside the interpreter
        bin_dir = str(Path(sys.executable).parent)
        if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
        if shutil.which("ninja") is None or shutil.which(os.environ.get("CXX", "c++")) is None:
            log.warning("skinny linear kernel: no ninja or C++ compiler; using MKL/oneDNN for few-row calls")
            return None
        try:
            from torch.utils.cpp_extension import load as build

            clear_stale_build_lock("specsplit_skinny_linear")
            _module = build("specsplit_skinny_linear", [str(SOURCE)], extra_cflags=["-O3", "-mavx2", "-mfma"],
                            verbose=False)
        except Exception as e:  # a missing header, an old compiler: fall back, say why
            log.warning("skinny linear kernel: build failed (%s); using MKL/oneDNN for few-row calls", e)
            _module = None
        return _module


def clear_stale_build_lock(name: str, max_age_s: float = 600.0) -> None:
    """torch's extension build holds a lock file in its build directory; a process killed while
    compiling leaves it behind, and every later build of that extension then waits on it forever.
    A lock older than any build (about 25 s here) is such a leftover: remove it."""
    import time

    from torch.utils.cpp_extension import _get_build_directory

    try:
        lock = Path(_get_build_directory(name, verbose=False)) / "lock"
        if time.time() - lock.stat().st_mtime > max_age_s:
            log.warning("removing a stale build lock left by a killed build: %s", lock)
            lock.unlink()
    except (OSError, RuntimeError):  # no lock (the usual case), or no build directory yet
        pass


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] fp32 -> [ceil(N/16), K, 16], the layout `linear` reads."""
    return load().skinny_pack(weight.detach().contiguous())


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] fp32 -> [M, out_features]; equal to `reference` within fp32 summation order."""
    return load().skinny_linear(x, packed, out_features, bias)


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)
