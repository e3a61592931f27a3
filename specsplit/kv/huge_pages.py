"""Transparent huge pages on the CPU: the quantized blocks a decode step streams, copied into one
buffer that the kernel backs with 2 MB pages (madvise(MADV_HUGEPAGE) before the first touch), and
the paged KV cache allocated the same way (`empty`).

A decode step of SmolLM2-135M Q4_1 reads ~96 MB of blocks once each. In 4 KB pages that is ~24,000
pages a step: a TLB miss at each, and the hardware prefetchers stop at every page boundary.
Measured on the Intel Xeon (AMX, 1 thread), all 120 linears and the head in model order, median of
11 (docs/kernels.md, "AMX tiles and huge pages"): 12.1 -> 9.5 ms at one token row, 13.1 -> 11.0 ms
at three.

The KV cache (kv/paged_cache.py): a one-token step at context 300 / 600 / 1200 took 12.40 / 15.22
/ 18.59 ms against 12.58 / 15.58 / 19.14 ms in 4 KB pages (same Xeon, the two caches alternating
under one model, 9 rounds).

Where the kernel has no transparent huge pages ("never", or not Linux), or SPECSPLIT_HUGE_PAGES=0,
`into_huge_pages` gives the tensors back as they are and `empty` is torch.empty. Each buffer is one
torch tensor, so the memory count sees it (once, with its alignment slack: at most 2 MB, plus 4 KB
per tensor copied in).
"""
from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)

ENV_SWITCH = "SPECSPLIT_HUGE_PAGES"  # "0": 4 KB pages (weights where they were loaded, a plain KV cache)
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
HUGE_PAGE = 2 << 20
PAGE = 4096
MADV_HUGEPAGE = 14  # linux/mman.h
MADV_DONTNEED = 4


def available() -> bool:
    """Transparent huge pages can be asked for here (Linux, THP "always" or "madvise")."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return False
    try:
        return "[never]" not in THP_SETTING.read_text()
    except OSError:
        return False


def _advised_buffer(nbytes: int) -> tuple[torch.Tensor, int] | None:
    """A uint8 buffer holding `nbytes` from a 2 MB boundary, advised MADV_HUGEPAGE with none of
    those pages backed yet: (buffer, offset of that boundary), or None where huge pages are not
    available or refused.

    torch.empty is not always untouched memory: below glibc's mmap threshold (which rises to the
    size of a freed mmapped chunk, up to 32 MB) it comes from heap memory an earlier tensor
    touched, already backed by 4 KB pages that the advice does not change (a 12 MB KV cache then
    came out in 4 KB pages, depending on what the process had freed before). So the range is also
    advised MADV_DONTNEED: its pages are dropped (torch.empty promises no contents) and the next
    touch faults them in as 2 MB pages. On fresh memory that drops nothing."""
    if not available():
        return None
    buf = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)  # a torch tensor: the memory meters see it
    start = -buf.data_ptr() % HUGE_PAGE  # the first 2 MB boundary inside it
    libc = ctypes.CDLL(None, use_errno=True)
    where = ctypes.c_void_p(buf.data_ptr() + start)
    whole_pages = ctypes.c_size_t(nbytes // PAGE * PAGE)  # DONTNEED must not reach past the buffer
    if (libc.madvise(where, ctypes.c_size_t(nbytes), MADV_HUGEPAGE) != 0
            or libc.madvise(where, whole_pages, MADV_DONTNEED) != 0):
        log.info("huge pages: madvise refused (errno %d); 4 KB pages", ctypes.get_errno())
        return None
    return buf, start


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.empty(shape, dtype) on the CPU, in huge pages where available (the KV cache)."""
    n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    got = _advised_buffer(n) if n >= HUGE_PAGE else None
    if got is None:
        return torch.empty(shape, dtype=dtype)
    buf, start = got
    return buf[start:start + n].view(dtype).view(shape)


def into_huge_pages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of `tensors` (CPU, contiguous) as views into one huge-page buffer, in the order given
    (put them in the order a step reads them), each starting on a 4 KB page; or the tensors
    themselves where huge pages are not available or madvise refuses."""
    if not tensors or any(t.device.type != "cpu" for t in tensors):
        return tensors
    sizes = [t.numel() * t.element_size() for t in tensors]
    got = _advised_buffer(sum(-(-n // PAGE) * PAGE for n in sizes))
    if got is None:
        return tensors
    buf, start = got
    out, offset = [], start
    for t, n in zip(tensors, sizes):
        view = buf[offset:offset + n].view(t.dtype).view(t.shape)
        view.copy_(t)
        out.append(view)
        offset += -(-n // PAGE) * PAGE
    return out
