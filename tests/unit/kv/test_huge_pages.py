"""kv/huge_pages: weights copied into one buffer that the kernel backs with 2 MB pages (equal
copies, one storage, each on its own 4 KB page in the order given) and the KV cache allocated in
such pages, the pages really huge where the machine gives transparent huge pages; switched off,
the tensors come back untouched."""
from __future__ import annotations

import re

import pytest
import torch

from specsplit.kv import huge_pages


def anon_huge_kb(ptr: int) -> int:
    """AnonHugePages of the mapping holding address `ptr` (/proc/self/smaps)."""
    text = open("/proc/self/smaps").read()
    for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", text):
        lo, hi = (int(v, 16) for v in block.split()[0].split("-"))
        if lo <= ptr < hi:
            return int(re.search(r"AnonHugePages:\s+(\d+) kB", block).group(1))
    raise AssertionError(f"no mapping holds {ptr:#x}")


def test_copies_share_one_buffer_in_order():
    if not huge_pages.available():
        pytest.skip("no transparent huge pages on this machine")
    g = torch.Generator().manual_seed(0)
    ts = [torch.randint(0, 256, (n, 64), dtype=torch.uint8, generator=g) for n in (3000, 5, 70000)]
    ts.append(torch.randn(10, 7, generator=g))  # any dtype and shape
    out = huge_pages.into_huge_pages(ts)
    assert all(torch.equal(a, b) and a.shape == b.shape and a.dtype == b.dtype for a, b in zip(out, ts))
    assert len({o.untyped_storage().data_ptr() for o in out}) == 1
    ptrs = [o.data_ptr() for o in out]
    assert ptrs == sorted(ptrs) and all(p % huge_pages.PAGE == 0 for p in ptrs)
    assert ptrs[0] % huge_pages.HUGE_PAGE == 0
    assert anon_huge_kb(ptrs[2]) >= 2048  # the 4.5 MB tensor spans whole 2 MB pages


def test_switched_off_gives_the_tensors_back(monkeypatch):
    ts = [torch.zeros(4, dtype=torch.uint8)]
    monkeypatch.setenv(huge_pages.ENV_SWITCH, "0")
    assert not huge_pages.available()
    assert huge_pages.into_huge_pages(ts)[0] is ts[0]
    assert huge_pages.into_huge_pages([]) == []


def test_zeros_and_the_kv_cache_are_in_huge_pages():
    if not huge_pages.available():
        pytest.skip("no transparent huge pages on this machine")
    from specsplit.kv.paged_cache import PagedKVCache

    t = huge_pages.zeros((3, 1 << 20), torch.float32)  # 12 MB
    assert t.shape == (3, 1 << 20) and t.dtype == torch.float32 and t.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert anon_huge_kb(t.data_ptr()) >= 2048
    cache = PagedKVCache(num_layers=2, num_blocks=64, block_size=16, num_kv_heads=4, head_dim=64,
                         dtype=torch.float32, device="cpu")  # 4 MB
    assert cache.data.data_ptr() % huge_pages.HUGE_PAGE == 0 and not bool(cache.data.any())
    assert anon_huge_kb(cache.data.data_ptr()) >= 2048
    small = huge_pages.zeros((10,), torch.float32)  # under one huge page: plain torch.zeros
    assert small.shape == (10,) and not bool(small.any())


def test_a_buffer_after_freed_heap_memory_is_still_in_huge_pages():
    """glibc serves an allocation below its mmap threshold (which rises to the size of a freed
    mmapped chunk, up to 32 MB) from heap memory an earlier tensor touched: already in 4 KB pages,
    which the advice does not change. The buffer is its own mapping, so it is huge anyway. (A fresh
    process: the allocator's history is process-wide.)"""
    import subprocess
    import sys

    if not huge_pages.available():
        pytest.skip("no transparent huge pages on this machine")
    script = (
        "import re, torch\n"
        "from specsplit.kv import huge_pages\n"
        "x = torch.ones(20 << 20, dtype=torch.uint8); del x\n"  # mmapped, freed: the threshold rises to 20 MB
        "y = torch.ones(16 << 20, dtype=torch.uint8); del y\n"  # from the heap now: touched, freed
        "t = huge_pages.zeros((12 << 20,), torch.uint8)\n"
        "from tests.unit.kv.test_huge_pages import anon_huge_kb\n"
        "print(anon_huge_kb(t.data_ptr()))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         cwd=str(__import__("pathlib").Path(__file__).resolve().parents[3]))
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.split()[-1]) >= 2048


def test_zeros_takes_huge_pages_within_its_budget_and_4k_pages_past_it(caplog):
    """The KV cache's buffer: zeroed, in huge pages while zeroing stays within the budget; with no
    budget left, the rest is advised out of huge pages (the log says so) and is still all zeros."""
    if not huge_pages.available():
        pytest.skip("no transparent huge pages on this machine")
    shape = (3, 1 << 20)  # 12 MB
    t = huge_pages.zeros(shape, torch.float32)  # the default budget: seconds for 12 MB
    assert t.shape == shape and t.dtype == torch.float32 and not bool(t.any())
    assert anon_huge_kb(t.data_ptr()) >= 2048
    with caplog.at_level("INFO", logger=huge_pages.__name__):
        late = huge_pages.zeros(shape, torch.float32, budget_s=-1.0, what="test cache")
    assert late.shape == shape and not bool(late.any())
    assert anon_huge_kb(late.data_ptr()) == 0
    assert "test cache of 0.01 GiB: 0.00 GiB in huge pages" in caplog.text and "the rest in 4 KB pages" in caplog.text
    late.fill_(1.0)  # faulted in now, as 4 KB pages
    assert anon_huge_kb(late.data_ptr()) == 0


def test_zeros_switched_off_is_torch_zeros(monkeypatch):
    monkeypatch.setenv(huge_pages.ENV_SWITCH, "0")
    t = huge_pages.zeros((3, 1 << 20), torch.float32)
    assert t.shape == (3, 1 << 20) and not bool(t.any())
