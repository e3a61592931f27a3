"""Transparent huge pages on the CPU: the quantized blocks a decode step streams, copied into one
buffer that the kernel backs with 2 MB pages (madvise(MADV_HUGEPAGE) before the first touch), and
the paged KV cache allocated the same way (`zeros`).

A decode step of SmolLM2-135M Q4_1 reads ~96 MB of blocks once each. In 4 KB pages that is ~24,000
pages a step: a TLB miss at each, and the hardware prefetchers stop at every page boundary.
Measured on the Intel Xeon (AMX, 1 thread), all 120 linears and the head in model order, median of
11 (docs/kernels.md, "AMX tiles and huge pages"): 12.1 -> 9.5 ms at one token row, 13.1 -> 11.0 ms
at three.

The KV cache (kv/paged_cache.py): a one-token step at context 300 / 600 / 1200 took 12.40 / 15.22
/ 18.59 ms against 12.58 / 15.58 / 19.14 ms in 4 KB pages (same Xeon, the two caches alternating
under one model, 9 rounds). It is zeroed at start-up (`zeros`), and with the kernel's default THP
defrag setting ("madvise") each huge page fault may first reclaim and compact memory: the default
server's 2.8 GiB cache took 0.5 s where free huge pages were plenty and 8.9 s after a long test run
had filled memory with page cache (in 4 KB pages: 1.1 s). So the cache takes huge pages for
`ZERO_BUDGET_S` of faulting and the rest in 4 KB pages, and the log says how much went where.

Where the kernel has no transparent huge pages ("never", or not Linux), or SPECSPLIT_HUGE_PAGES=0,
`into_huge_pages` gives the tensors back as they are and `zeros` is torch.zeros. Each buffer is one torch tensor, so the memory count sees it (once, with its
alignment slack: at most 2 MB, plus 4 KB per tensor copied in).
"""
from __future__ import annotations

import ctypes
import logging
import os
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

ENV_SWITCH = "SPECSPLIT_HUGE_PAGES"  # "0": 4 KB pages (weights where they were loaded, a plain KV cache)
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
HUGE_PAGE = 2 << 20
PAGE = 4096
MADV_HUGEPAGE = 14  # linux/mman.h
MADV_DONTNEED = 4
MADV_NOHUGEPAGE = 15
# zeros(): seconds of huge page faults before the rest of the buffer goes to 4 KB pages, and the
# bytes zeroed between two looks at the clock
ZERO_BUDGET_S = 1.5
ZERO_CHUNK = 64 << 20


def available() -> bool:
    """Transparent huge pages can be asked for here (Linux, THP "always" or "madvise")."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return False
    try:
        return "[never]" not in THP_SETTING.read_text()
    except OSError:
        return False


def _madvise(addr: int, length: int, advice: int) -> int:
    """madvise(2) on [addr, addr + length): 0, or the errno of its refusal."""
    libc = ctypes.CDLL(None, use_errno=True)
    return 0 if libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(length), advice) == 0 else ctypes.get_errno()


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
    where = buf.data_ptr() + start
    # DONTNEED over whole pages only: it must not reach past the buffer
    refused = _madvise(where, nbytes, MADV_HUGEPAGE) or _madvise(where, nbytes // PAGE * PAGE, MADV_DONTNEED)
    if refused:
        log.info("huge pages: madvise refused (errno %d); 4 KB pages", refused)
        return None
    return buf, start


def zeros(shape: tuple[int, ...], dtype: torch.dtype, budget_s: float = ZERO_BUDGET_S,
          what: str = "buffer") -> torch.Tensor:
    """torch.zeros(shape, dtype) on the CPU (the KV cache), in huge pages while the kernel hands
    them out quickly: zeroed ZERO_CHUNK bytes at a time, and once that has taken `budget_s`, the
    rest of the buffer is advised MADV_NOHUGEPAGE and faults in as 4 KB pages (see the module's
    docstring). Logs the split when there is one (`what` names the buffer)."""
    n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    got = _advised_buffer(n) if n >= HUGE_PAGE else None
    if got is None:
        return torch.zeros(shape, dtype=dtype)
    buf, start = got
    flat = buf[start:start + n]
    t0, done = time.perf_counter(), 0
    while done < n:
        if time.perf_counter() - t0 > budget_s:
            refused = _madvise(flat.data_ptr() + done, n - done, MADV_NOHUGEPAGE)
            flat[done:].zero_()
            log.info("huge pages: %s of %.2f GiB: %.2f GiB in huge pages in %.1f s, the rest in %s (%.1f s in all)",
                     what, n / 2**30, done / 2**30, budget_s,
                     f"huge pages too (madvise refused: errno {refused})" if refused else "4 KB pages",
                     time.perf_counter() - t0)
            break
        end = min(n, done + ZERO_CHUNK)
        flat[done:end].zero_()
        done = end
    return flat.view(dtype).view(shape)


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
