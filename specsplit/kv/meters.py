"""Measuring memory for the profiler: device size, live torch bytes, process memory.

Nothing here estimates from shapes or configs; every number comes from the allocator, the
tensors themselves or the OS.

* CUDA: the caching allocator's statistics (`memory_allocated`, `max_memory_allocated`,
  `memory_reserved`) for torch, `mem_get_info` for the device as a whole.
* CPU, torch: a TorchDispatchMode sees every op, counts the storage of each new output (views and
  in-place results share a storage and are skipped) and, through a weakref finalizer, the moment
  that storage is freed; the running sum is live bytes, its maximum the peak. Exact for tensors,
  cheap (no recording), so RSS can be watched during the same run. The c10 allocator's own event
  stream (the autograd profiler's memory events) is available as method="allocator": exact to the
  byte including kernels' internal scratch, but it holds ~10 KiB per op while it records.
* CPU, process: the resident set (RSS) and its high-water mark (VmHWM, reset through
  /proc/self/clear_refs); malloc_trim hands malloc's free pages back first so RSS is memory in use.
"""
from __future__ import annotations

import gc
import os
import re
import weakref
from dataclasses import dataclass

import torch

# ---- sizes of things ----------------------------------------------------------------------------


def _cgroup_limit() -> int | None:
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = open(path).read().strip()
        except OSError:
            continue
        if text.isdigit():
            return int(text)
    return None


def _meminfo(field: str) -> int | None:
    try:
        m = re.search(rf"^{field}:\s+(\d+) kB", open("/proc/meminfo").read(), re.M)
    except OSError:
        return None
    return int(m.group(1)) * 1024 if m else None


def host_memory() -> tuple[int, int]:
    """(total, available) bytes of system RAM, within this process's cgroup limit if it has one."""
    try:
        import psutil

        vm = psutil.virtual_memory()
        total, available = int(vm.total), int(vm.available)
    except ImportError:  # pragma: no cover - psutil is installed with the project
        total = _meminfo("MemTotal") or 0
        available = _meminfo("MemAvailable") or total
    limit = _cgroup_limit()
    if limit is not None and 0 < limit < total:
        total = limit
        available = min(available, max(0, limit - _cgroup_usage()))
    return total, available


def _cgroup_usage() -> int:
    for path in ("/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory/memory.usage_in_bytes"):
        try:
            return int(open(path).read().strip())
        except (OSError, ValueError):
            continue
    return 0


def device_memory(device: torch.device) -> tuple[int, int]:
    """(total, free) bytes of the device: system RAM for cpu, mem_get_info for cuda."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(total), int(free)
    if device.type == "cpu":
        return host_memory()
    raise ValueError(f"the memory profiler supports cpu and cuda devices, not {device}")


def rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # pragma: no cover - not Linux
        import psutil

        return int(psutil.Process().memory_info().rss)


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """VmHWM: the most this process has had resident since start (or the last reset)."""
    try:
        m = re.search(r"^VmHWM:\s+(\d+) kB", open("/proc/self/status").read(), re.M)
        if m:
            return int(m.group(1)) * 1024
    except OSError:  # pragma: no cover
        pass
    return rss_bytes()


def trim_host_memory() -> None:
    """Give the C allocator's free pages back to the OS (glibc malloc_trim), so RSS is memory in
    use. Tensors torch freed below the mmap threshold otherwise stay resident in malloc's arenas."""
    global _libc
    if _libc is None:
        try:
            import ctypes

            _libc = ctypes.CDLL("libc.so.6")
            _libc.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _libc = False
    if _libc:
        _libc.malloc_trim(0)


_libc = None


def collect(full: bool = False) -> None:
    """Free what waits for the garbage collector. Young generations only unless `full`: a full
    collection of a process that imported transformers takes most of a second."""
    gc.collect() if full else gc.collect(1)


# ---- live torch bytes over a window -----------------------------------------------------------


class _AllocatorTrace:
    """CPU: the c10 allocator's own alloc/free events (the autograd profiler, memory only)."""

    method = "cpu allocator events"

    def __init__(self):
        from torch.autograd import ProfilerConfig, ProfilerState

        self._config = ProfilerConfig(
            ProfilerState.CPU, False, True, False, False, False, torch._C._profiler._ExperimentalConfig()
        )
        self.net = 0
        self.peak = 0

    def start(self) -> None:
        from torch.autograd import _enable_profiler_legacy

        _enable_profiler_legacy(self._config)

    def stop(self) -> None:
        from torch.autograd import _disable_profiler_legacy

        threads = _disable_profiler_legacy()
        events: list[tuple[float, int, int, int]] = []
        for t, records in enumerate(threads):
            for i, r in enumerate(records):
                if r.kind() == "memory_alloc" and r.device() == -1:
                    events.append((r.start_us(), t, i, r.cpu_memory_usage()))
        events.sort()
        live = peak = 0
        for *_, nbytes in events:
            live += nbytes
            peak = max(peak, live)
        self.net, self.peak = live, peak


class _StorageTrace:
    """CPU fallback: storages of op outputs (a TorchDispatchMode) and the moment each is freed."""

    method = "tensor storages (dispatch mode)"

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        trace = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                returns = func._schema.returns
                outs = out if isinstance(out, (tuple, list)) and len(returns) > 1 else (out,)
                for ret, value in zip(returns, outs):
                    if ret.alias_info is not None:  # a view or an in-place result: no new memory
                        continue
                    for t in tree_leaves(value):
                        # Opaque oneDNN tensors (prepacked weights) have no storage; the model
                        # reports their bytes itself (LlamaForCausalLM.untracked_weight_bytes).
                        if isinstance(t, torch.Tensor) and t.device.type == "cpu" and not t.is_mkldnn:
                            trace._saw(t.untyped_storage())
                return out

        self._mode = _Mode()
        self._sizes: dict[int, int] = {}
        self.live = 0
        self.net = 0
        self.peak = 0

    def _saw(self, storage) -> None:
        key = storage._cdata
        if key in self._sizes:
            return
        n = storage.nbytes()
        self._sizes[key] = n
        self.live += n
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._freed, key)

    def _freed(self, key: int) -> None:
        n = self._sizes.pop(key, 0)
        self.live -= n

    def start(self) -> None:
        self._mode.__enter__()

    def stop(self) -> None:
        self._mode.__exit__(None, None, None)
        # Storages still alive stay counted in `live` (and so in net) until they are freed.
        self.net = self.live


class _CudaStats:
    method = "cuda allocator statistics"

    def __init__(self, device: torch.device):
        self.device = device
        self.net = 0
        self.peak = 0

    def start(self) -> None:
        torch.cuda.synchronize(self.device)
        self._start = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def stop(self) -> None:
        torch.cuda.synchronize(self.device)
        self.net = torch.cuda.memory_allocated(self.device) - self._start
        self.peak = torch.cuda.max_memory_allocated(self.device) - self._start


_warmed = False


def warm_up_storage_trace() -> None:
    """Pay the dispatch-mode machinery's one-time cost (imports, ~100+ MiB of RSS the first time a
    TorchDispatchMode runs in a process) now, before a baseline is taken: it is the instrument's
    memory, not the service's."""
    global _warmed
    if not _warmed:
        t = _StorageTrace()
        t.start()
        torch.empty(1) + 1
        t.stop()
        _warmed = True


class TorchMeter:
    """Live torch bytes on one device over a `with` block: `net` change and `peak` above the start.

        with TorchMeter(device) as m:
            run()
        m.net, m.peak

    method (CPU): "storages" (default) counts the storage of every op output as it is created and
    when it is freed (a TorchDispatchMode): exact for tensors, no memory overhead, so the process's
    RSS can be watched at the same time; it does not see a kernel's internal scratch buffers (those
    show in RSS, so the profiler counts them as non-torch). "allocator" records the c10 CPU
    allocator's own events: exact to the byte, scratch included, but the recorder holds ~10 KiB
    per op until the block ends, so RSS is not meaningful meanwhile; it cannot nest, and falls
    back to "storages" under a running profiler. CUDA always reads the allocator's statistics.
    """

    def __init__(self, device: torch.device | str, method: str = "storages"):
        self.device = torch.device(device)
        if self.device.type == "cuda":
            self._impl = _CudaStats(self.device)
        elif self.device.type == "cpu":
            if method not in ("storages", "allocator"):
                raise ValueError(f"method must be 'storages' or 'allocator', got {method!r}")
            use_allocator = method == "allocator" and not torch.autograd._profiler_enabled()
            self._impl = _AllocatorTrace() if use_allocator else _StorageTrace()
        else:
            raise ValueError(f"the memory profiler supports cpu and cuda devices, not {self.device}")
        self.net = 0
        self.peak = 0

    @property
    def method(self) -> str:
        return self._impl.method

    def __enter__(self) -> "TorchMeter":
        self._impl.start()
        return self

    def __exit__(self, *exc) -> None:
        collect()  # garbage the block made is not live memory
        self._impl.stop()
        self.net, self.peak = self._impl.net, max(self._impl.peak, self._impl.net, 0)


# ---- process / device memory outside torch ----------------------------------------------------


@dataclass
class ProcessSnapshot:
    """What the process (CPU) or the device (CUDA) has in use, and how much of it torch holds."""

    used: int  # cpu: RSS; cuda: total - free on the device
    torch_reserved: int  # cpu: 0 (torch frees to the OS allocator); cuda: memory_reserved


def process_snapshot(device: torch.device) -> ProcessSnapshot:
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return ProcessSnapshot(int(total - free), int(torch.cuda.memory_reserved(device)))
    return ProcessSnapshot(rss_bytes(), 0)


def tensor_storage_bytes(module: torch.nn.Module) -> int:
    """Bytes of the distinct storages behind a module's parameters, buffers and tensor attributes.

    Opaque oneDNN tensors (prepacked CPU weights) have no storage: a model that holds them reports
    their bytes as `untracked_weight_bytes`, which is added here."""
    seen: dict[int, int] = {}

    def add(t) -> None:
        if isinstance(t, torch.Tensor) and not t.is_mkldnn:
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()

    for m in module.modules():
        for t in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False)):
            add(t)
        for v in vars(m).values():
            add(v)
    return sum(seen.values()) + int(getattr(module, "untracked_weight_bytes", 0) or 0)
