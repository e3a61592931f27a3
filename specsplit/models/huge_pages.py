"""Weights in transparent huge pages: the quantized blocks a CPU decode step streams, copied into one
buffer that the kernel backs with 2 MB pages (madvise(MADV_HUGEPAGE) before the first touch).

A decode step of SmolLM2-135M Q4_1 reads ~96 MB of blocks once each. In 4 KB pages that is ~24,000
pages a step: a TLB miss at each, and the hardware prefetchers stop at every page boundary.
Measured on the Intel Xeon (AMX, 1 thread), all 120 linears and the head in model order, median of
11 (`/work/probe`-style timing, docs/kernels.md): 12.1 -> 9.5 ms at one token row, 13.1 -> 11.0 ms
at three.

Where the kernel has no transparent huge pages ("never", or not Linux), or SPECSPLIT_HUGE_PAGES=0,
`into_huge_pages` gives the tensors back as they are. The buffer is one torch tensor, so the memory
count sees it (once, with its alignment slack: at most 2 MB + 4 KB per tensor).
"""
from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)

ENV_SWITCH = "SPECSPLIT_HUGE_PAGES"  # "0": leave the weights where they were loaded
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
HUGE_PAGE = 2 << 20
PAGE = 4096
MADV_HUGEPAGE = 14  # linux/mman.h


def available() -> bool:
    """Transparent huge pages can be asked for here (Linux, THP "always" or "madvise")."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return False
    try:
        return "[never]" not in THP_SETTING.read_text()
    except OSError:
        return False


def into_huge_pages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of `tensors` (CPU, contiguous) as views into one huge-page buffer, in the order given
    (put them in the order a step reads them), each starting on a 4 KB page; or the tensors
    themselves where huge pages are not available or madvise refuses."""
    if not tensors or not available() or any(t.device.type != "cpu" for t in tensors):
        return tensors
    sizes = [t.numel() * t.element_size() for t in tensors]
    total = sum(-(-n // PAGE) * PAGE for n in sizes)
    buf = torch.empty(total + HUGE_PAGE, dtype=torch.uint8)  # untouched: no page is backed yet
    start = -buf.data_ptr() % HUGE_PAGE  # the first 2 MB boundary inside it
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.madvise(ctypes.c_void_p(buf.data_ptr() + start), ctypes.c_size_t(total), MADV_HUGEPAGE) != 0:
        log.info("huge pages: madvise refused (errno %d); weights stay in 4 KB pages", ctypes.get_errno())
        return tensors
    out, offset = [], start
    for t, n in zip(tensors, sizes):
        view = buf[offset:offset + n].view(t.dtype).view(t.shape)
        view.copy_(t)
        out.append(view)
        offset += -(-n // PAGE) * PAGE
    return out
