"""MemoryProfiler: measure what a service uses, then size its KV cache from what the budget leaves.

    kv_cache_bytes <= budget - weights - activation_peak - non_torch

* budget: the device's memory x --memory-utilization (default 0.9), or --memory-budget BYTES.
  On CPU the device's memory is system RAM (within the cgroup limit, if any).
* weights: live torch bytes the model load left behind, measured across the load (the allocator
  statistics on CUDA; on CPU every tensor storage created during the load and still alive after
  it; see specsplit.kv.meters).
* activation peak: the highest live torch bytes above the start of a profile run, in which the
  real engine code runs its largest steps (specsplit.profile_run): max_num_seqs sequences of
  k+1 new tokens, the same with one max_prefill_tokens prompt chunk, and a burst of short prompts,
  all at max_model_len tokens of context, sampling on. BoundedRunner keeps every later forward
  inside that shape.
* non-torch: memory the service's start-up added that torch tensors do not explain.
  CUDA: growth of the device's used memory (mem_get_info) minus growth of torch's reserved pool,
  from before the first load to the end of the profile run (CUDA context work, cuBLAS workspaces,
  another process's growth on a shared device).
  CPU: the process's peak resident set during the profile run (VmHWM, reset just before it)
  above its resident set before the first load, minus the torch bytes live at that peak (the
  weights plus the activation peak). That is what the C allocator keeps in its arenas beyond
  live tensors (fragmentation), Python objects, libraries imported or paged in on first use
  during start-up, the tokenizer of a colocated server. Free pages malloc keeps are handed back
  first (malloc_trim) at the baseline, after each load and around the profile run, so RSS counts
  memory in use. The interpreter and the libraries imported before start-up are outside the
  budget (as the CUDA context made before start-up is).

Colocated on one device there is one budget: both models' weights, both activation peaks (the
draft's rows live until the verifier is done with them, so they are added, not maxed) and both
non-torch growths come off it first; the rest is split so both caches hold the same number of
tokens. The cache is never made larger than the scheduler can fill (max_num_seqs sequences of
max_model_len tokens); the plan says so (`kv_limited_by`) and how much the budget left.

A budget that cannot hold the weights, or one sequence of max_model_len tokens, or a plan larger
than the memory free on the device when start-up began, raises MemoryBudgetError with the
numbers, before any KV cache is allocated.
"""
from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from typing import Callable, TypeVar

import torch

from specsplit.kv.meters import (
    ProcessSnapshot,
    TorchMeter,
    device_memory,
    peak_rss_bytes,
    process_snapshot,
    reset_peak_rss,
    rss_bytes,
    trim_host_memory,
    warm_up_storage_trace,
)
from specsplit.kv.block_manager import too_few_blocks
from specsplit.kv.paged_cache import PagedKVCache

log = logging.getLogger(__name__)
# Host memory of serving that no profile run sees (request objects, detokenizer and scheduler
# state, stream buffers), and the jitter of measuring non-torch growth by RSS at page and malloc-
# arena granularity. Measured on a full colocated run at max_num_seqs 4 (tests/unit/kv/
# test_profiler_seed.py, 18 runs on an Intel Xeon and CI): the run's peak RSS ended 0.2-1.2 MiB
# past what the profile attributed to torch and non-torch; at 1 MiB it failed CI by 12 KB. 2 MiB
# keeps 0.8 MiB over the worst seen. Added once per process (CPU) to the non-torch bytes of the
# first service measured.
HOST_RESERVE_BYTES = 2 << 20

T = TypeVar("T")
SERVICES = ("verifier", "drafter")
_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


class MemoryBudgetError(ValueError):
    """The budget cannot hold what the service needs; the message has the numbers."""


def fmt_bytes(n: int | float) -> str:
    n = float(n)
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1024
    return f"{sign}{n:.2f} TiB"  # pragma: no cover


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


# ---- the plan -----------------------------------------------------------------------------------


@dataclass
class ServicePlan:
    """One service's share of memory. All sizes in bytes; zeros for the n-gram drafter."""

    service: str  # "verifier" | "drafter"
    model: str
    device: str
    dtype: str
    budget_bytes: int  # split: the service's budget; joint: its share of the joint budget
    weights_bytes: int = 0
    activation_peak_bytes: int = 0
    non_torch_bytes: int = 0
    kv_cache_bytes: int = 0
    num_blocks: int = 0
    block_size: int = 0
    max_tokens: int = 0  # tokens the KV cache holds (num_blocks x block_size)
    kv_bytes_per_block: int = 0
    kv_available_bytes: int = 0  # what the budget left for this cache
    kv_limited_by: str = "budget"  # "budget" | "max_num_seqs" (scheduler can fill no more) | "num_blocks" (--num-blocks)
    max_model_len: int = 0
    max_num_seqs: int = 0
    weights: str = ""  # how the weights are held: "fp32", "native Q4_1 x120, Q8_0 x1 (96.4 MB)" ('' = dtype)

    @classmethod
    def zeros(cls, service: str, model: str, device: str = "cpu") -> "ServicePlan":
        return cls(service=service, model=model, device=device, dtype="none", budget_bytes=0, kv_limited_by="none")

    @property
    def used_bytes(self) -> int:
        return self.weights_bytes + self.activation_peak_bytes + self.non_torch_bytes + self.kv_cache_bytes

    @property
    def max_concurrency(self) -> float:
        """How many sequences of max_model_len tokens the cache holds at once."""
        return self.max_tokens / self.max_model_len if self.max_model_len else 0.0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class MemoryPlan:
    """The memory plan of a deployment: one or two services, one joint budget or one each.

    to_dict() is what `specsplit profile --json` prints and GetServerInfo returns:
    {"joint": bool, "budget_bytes": int, "services": {"verifier": {...}, "drafter": {...}}}.
    With separate budgets, the top-level budget_bytes is their sum.
    """

    joint: bool
    budget_bytes: int
    services: dict[str, ServicePlan] = field(default_factory=dict)
    method: str = ""  # how torch memory was measured

    def to_dict(self) -> dict:
        return {
            "joint": self.joint,
            "budget_bytes": self.budget_bytes,
            "services": {name: s.to_dict() for name, s in self.services.items()},
            "method": self.method,
        }

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), **kw)

    @classmethod
    def from_dict(cls, d: dict) -> "MemoryPlan":
        return cls(
            joint=bool(d["joint"]),
            budget_bytes=int(d["budget_bytes"]),
            services={k: ServicePlan(**v) for k, v in d["services"].items()},
            method=d.get("method", ""),
        )

    @classmethod
    def merge(cls, plans: list["MemoryPlan"]) -> "MemoryPlan":
        """Separate services' plans (e.g. the verifier's and the drafter's) as one."""
        if len(plans) == 1:
            return plans[0]
        services: dict[str, ServicePlan] = {}
        for p in plans:
            services.update(p.services)
        methods = sorted({p.method for p in plans if p.method})
        return cls(joint=False, budget_bytes=sum(p.budget_bytes for p in plans), services=services, method=", ".join(methods))

    def log_lines(self) -> list[str]:
        lines = []
        weights = " + ".join(
            f"{'target' if s.service == 'verifier' else 'draft'} {fmt_bytes(s.weights_bytes)}" for s in self.services.values()
        )
        for s in self.services.values():
            if s.kv_limited_by == "none":  # the n-gram / suffix drafters, or an EAGLE-3 head on a drafter service
                held = f"weights {fmt_bytes(s.weights_bytes)}" if s.weights_bytes else "no weights"
                if s.weights_bytes and s.weights:
                    held += f" [{s.weights}]"
                extra = ""
                if s.non_torch_bytes:  # a suffix cache's bound, or the head's grammar compiler (its tokenizer)
                    extra = (f"; host memory {fmt_bytes(s.non_torch_bytes)} (its grammar compiler)" if s.weights_bytes
                             else f"; host memory up to {fmt_bytes(s.non_torch_bytes)} (its cache)")
                kv = "a KV cache per sequence as it grows (not paged)" if s.weights_bytes else "no KV cache"
                if s.weights_bytes and s.activation_peak_bytes:
                    kv += f", up to {fmt_bytes(s.activation_peak_bytes)} (max_num_seqs x max_model_len tokens)"
                lines.append(f"memory plan [{s.service}] {s.model}: {held}, {kv}{extra}")
                continue
            budget = (
                f"joint budget {fmt_bytes(self.budget_bytes)} (share {fmt_bytes(s.budget_bytes)})"
                if self.joint
                else f"budget {fmt_bytes(s.budget_bytes)}"
            )
            w = f"weights {weights}" if self.joint else f"weights {fmt_bytes(s.weights_bytes)}"
            if s.weights and s.weights != s.dtype:
                w += f" [{s.weights}]"
            cap = "" if s.kv_limited_by == "budget" else f", capped by {s.kv_limited_by} (budget left {fmt_bytes(s.kv_available_bytes)})"
            lines.append(
                f"memory plan [{s.service}] {s.model} on {s.device} ({s.dtype}): {budget}; {w}; "
                f"activation peak {fmt_bytes(s.activation_peak_bytes)}; non-torch {fmt_bytes(s.non_torch_bytes)}; "
                f"KV cache {fmt_bytes(s.kv_cache_bytes)} = {s.num_blocks} blocks x {s.block_size} = {s.max_tokens} tokens "
                f"({s.max_concurrency:.2f}x max_model_len {s.max_model_len}){cap}"
            )
        return lines

    def log(self, logger: logging.Logger = log) -> None:
        for line in self.log_lines():
            logger.info("%s", line)


# ---- what the profiler needs to know about a service ------------------------------------------


@dataclass
class KVShape:
    """What sizes one service's cache: bytes per block and what the scheduler can fill."""

    block_size: int
    bytes_per_block: int
    max_model_len: int
    max_num_seqs: int
    num_blocks_override: int = 0  # --num-blocks
    cap: bool = True  # never more than max_num_seqs x max_model_len tokens

    @classmethod
    def for_model(cls, model_cfg, dtype: torch.dtype, block_size: int, max_model_len: int, max_num_seqs: int,
                  num_blocks: int = 0, cap: bool = True) -> "KVShape":
        per_block = PagedKVCache.bytes_per_block(model_cfg.num_layers, block_size, model_cfg.num_kv_heads, model_cfg.head_dim, dtype)
        return cls(block_size, per_block, max_model_len, max_num_seqs, num_blocks, cap)

    @property
    def bytes_per_token(self) -> float:
        return self.bytes_per_block / self.block_size

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    @property
    def min_blocks(self) -> int:
        return self.blocks_for(self.max_model_len)

    @property
    def max_useful_blocks(self) -> int:
        return self.max_num_seqs * self.min_blocks


@dataclass
class _Measured:
    weights: int = 0
    activation_peak: int = 0
    non_torch: int = 0
    shape_peaks: dict[str, int] = field(default_factory=dict)


# ---- the profiler -------------------------------------------------------------------------------


class MemoryProfiler:
    """Measures one budget's services on one device, then sizes their caches.

        prof = MemoryProfiler("cpu", budget_bytes=None, utilization=0.9)
        loaded = prof.load("verifier", lambda: load_model(...))         # weights
        prof.profile("verifier", make_scratch_engine, {"largest": run})  # activation peak, non-torch
        plan = prof.plan({"verifier": KVShape.for_model(...)}, models={...}, dtypes={...})

    (specsplit.factory wires this up for every kind of service.)

    Create it before anything of the service is loaded: its baseline is the process (CPU) or the
    device (CUDA) at that moment.
    """

    def __init__(self, device: torch.device | str, budget_bytes: int | None = None, utilization: float = 0.9,
                 joint: bool = False):
        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.init()
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
        if not 0.0 < utilization <= 1.0:
            raise ValueError(f"--memory-utilization must be in (0, 1], got {utilization}")
        if budget_bytes is not None and budget_bytes <= 0:
            raise ValueError(f"--memory-budget must be positive, got {budget_bytes}")
        self.joint = joint
        self.total_bytes, self.free_at_start = device_memory(self.device)
        self.utilization = utilization
        self.budget_source = "--memory-budget" if budget_bytes is not None else f"{utilization:g} x {fmt_bytes(self.total_bytes)} {self._device_word}"
        self.budget_bytes = int(budget_bytes) if budget_bytes is not None else int(self.total_bytes * utilization)
        if self.device.type == "cpu":
            warm_up_storage_trace()
        self._trim()
        self.base: ProcessSnapshot = process_snapshot(self.device)
        self._torch_live = 0  # tracked torch bytes since the baseline (CPU); CUDA reads the allocator
        self._cuda_alloc_base = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
        self.measured: dict[str, _Measured] = {}
        self._host_reserve_taken = False  # HOST_RESERVE_BYTES goes to the first measured service
        self.method = ""

    @property
    def _device_word(self) -> str:
        return "system RAM" if self.device.type == "cpu" else f"{self.device} memory"

    def _trim(self) -> None:
        if self.device.type == "cpu":
            trim_host_memory()

    def _m(self, service: str) -> _Measured:
        return self.measured.setdefault(service, _Measured())

    def _torch_now(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device) - self._cuda_alloc_base
        return self._torch_live

    def track(self, fn: Callable[[], T]) -> tuple[T, TorchMeter]:
        """Run fn under a TorchMeter; its net stays counted as tracked torch memory."""
        with TorchMeter(self.device) as meter:
            out = fn()
        self._torch_live += meter.net
        self.method = meter.method
        return out, meter

    # ---- measurements --------------------------------------------------------------------
    def load(self, service: str, load: Callable[[], T]) -> T:
        """Load a model; the torch bytes it leaves live are the service's weights."""
        out, meter = self.track(load)
        self._trim()  # the loader's freed temporaries are not the service's memory
        # Prepacked CPU weights live in opaque tensors no storage tracker sees; the model counts them.
        untracked = int(getattr(getattr(out, "model", out), "untracked_weight_bytes", 0) or 0)
        self._torch_live += untracked
        self._m(service).weights = max(0, meter.net) + untracked
        self._check_weights()
        return out

    def profile(self, service: str, setup: Callable[[], object], shapes: dict[str, Callable[[object], None]]) -> int:
        """Run the profile: setup() builds the scratch engine, each shape runs one step on it.

        Returns (and records) the activation peak: the highest live torch bytes above the start of
        the run, over all shapes. Non-torch growth is measured over the same window.
        """
        m = self._m(service)
        engine, scratch = self.track(setup)
        peaks: dict[str, int] = {}
        try:
            hwm = False
            if self.device.type == "cpu":
                trim_host_memory()
                hwm = reset_peak_rss()
            start = self._torch_now()
            for name, run in shapes.items():
                _, meter = self.track(lambda: run(engine))
                peaks[name] = meter.peak + (self._torch_now() - meter.net - start)  # above the run's start
            m.shape_peaks = peaks
            m.activation_peak = max(peaks.values(), default=0)
            m.non_torch = self._non_torch(start + m.activation_peak, hwm)
        finally:
            engine = None  # noqa: F841 - drop the scratch engine before the trim
            self._torch_live -= scratch.net  # the scratch cache and engine are gone
            self._trim()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
                torch.cuda.empty_cache()
        log.debug("profile run [%s]: peaks %s, non-torch %s", service, {k: fmt_bytes(v) for k, v in peaks.items()}, fmt_bytes(m.non_torch))
        return m.activation_peak

    def _non_torch(self, torch_at_peak: int, hwm: bool) -> int:
        """Growth since the baseline not explained by torch tensors (less what earlier services took).

        hwm: the RSS high-water mark was reset at the start of the profile run; where the kernel
        does not allow that, the RSS after the run stands in (its peak is then not seen)."""
        if self.device.type == "cuda":
            now = process_snapshot(self.device)
            growth = (now.used - self.base.used) - (now.torch_reserved - self.base.torch_reserved)
        else:
            rss = peak_rss_bytes() if hwm else rss_bytes()
            torch_then = torch_at_peak if hwm else self._torch_now()
            growth = (rss - self.base.used) - torch_then
        # what earlier services measured (their share of the process's growth), without the reserve
        earlier = sum(x.non_torch for x in self.measured.values()) - (HOST_RESERVE_BYTES if self._host_reserve_taken else 0)
        value = max(0, int(growth) - earlier)
        if self.device.type == "cpu" and not self._host_reserve_taken:
            self._host_reserve_taken = True
            value += HOST_RESERVE_BYTES
        return value

    def reserve(self, service: str, nbytes: int) -> None:
        """Memory a service takes as it runs that no profile step shows, counted as its activation
        peak: an EAGLE-3 head's KV cache, which grows per sequence (not paged) up to max_num_seqs x
        max_model_len tokens. A service measured without a KV shape (the head) still comes off
        the budget in plan()."""
        self._m(service).activation_peak = int(nbytes)

    def record(self, service: str, weights: int = 0, activation_peak: int = 0, non_torch: int = 0) -> None:
        """Set a service's measurements directly (numbers measured elsewhere, or tests of the sizing)."""
        m = self._m(service)
        m.weights, m.activation_peak, m.non_torch = int(weights), int(activation_peak), int(non_torch)
        self._check_weights()

    # ---- checks and sizing ---------------------------------------------------------------
    def _weights_line(self) -> tuple[int, str]:
        ws = {s: m.weights for s, m in self.measured.items() if m.weights}
        total = sum(ws.values())
        parts = " + ".join(f"{s} {fmt_bytes(w)}" for s, w in ws.items())
        return total, (parts + (f" = {fmt_bytes(total)}" if len(ws) > 1 else ""))

    def _check_weights(self) -> None:
        total, line = self._weights_line()
        if total > self.budget_bytes:
            raise MemoryBudgetError(
                f"memory budget {fmt_bytes(self.budget_bytes)} ({self.budget_source}) cannot hold the weights: "
                f"{line} ({total} > {self.budget_bytes} bytes). Raise --memory-budget or --memory-utilization, "
                "use a smaller --dtype, or put the draft on its own device."
            )

    def plan(self, shapes: dict[str, KVShape], models: dict[str, str], dtypes: dict[str, torch.dtype]) -> MemoryPlan:
        """Size the caches of the measured services (one, or two sharing this budget)."""
        self._check_weights()
        m = {s: self._m(s) for s in shapes}
        # every service measured here comes off this budget, those without a paged cache too
        fixed = sum(x.weights + x.activation_peak + x.non_torch for x in self.measured.values())
        available = self.budget_bytes - fixed
        per_token = sum(k.bytes_per_token for k in shapes.values())
        tokens = self._tokens(shapes, available, per_token)
        plans: dict[str, ServicePlan] = {}
        for s, k in shapes.items():
            blocks, limited = self._blocks(k, tokens)
            share = int(available * (k.bytes_per_token / per_token)) if per_token else 0
            plans[s] = ServicePlan(
                service=s,
                model=models[s],
                device=str(self.device),
                dtype=dtype_name(dtypes[s]),
                budget_bytes=0,
                weights_bytes=m[s].weights,
                activation_peak_bytes=m[s].activation_peak,
                non_torch_bytes=m[s].non_torch,
                kv_cache_bytes=blocks * k.bytes_per_block,
                num_blocks=blocks,
                block_size=k.block_size,
                max_tokens=blocks * k.block_size,
                kv_bytes_per_block=k.bytes_per_block,
                kv_available_bytes=max(0, share),
                kv_limited_by=limited,
                max_model_len=k.max_model_len,
                max_num_seqs=k.max_num_seqs,
            )
        for s, x in self.measured.items():  # no paged cache (an EAGLE-3 head): its fixed costs
            if s not in shapes:
                plans[s] = ServicePlan(
                    service=s, model=models.get(s, s), device=str(self.device), dtype=dtype_name(dtypes[s]) if s in dtypes else "none",
                    budget_bytes=0, weights_bytes=x.weights, activation_peak_bytes=x.activation_peak,
                    non_torch_bytes=x.non_torch, kv_limited_by="none",
                )
        # Shares of the budget: each service's fixed costs and its part of what was left.
        for s, p in plans.items():
            p.budget_bytes = p.weights_bytes + p.activation_peak_bytes + p.non_torch_bytes + p.kv_available_bytes
        first = next(iter(plans))
        plans[first].budget_bytes += self.budget_bytes - sum(p.budget_bytes for p in plans.values())
        plan = MemoryPlan(joint=self.joint or len(plans) > 1, budget_bytes=self.budget_bytes, services=plans, method=self.method)
        self._check_plan(plan, shapes, available)
        return plan

    def _tokens(self, shapes: dict[str, KVShape], available: int, per_token: float) -> int:
        """Tokens every cache holds: the most that fit together, no more than the scheduler can fill."""
        if any(k.num_blocks_override for k in shapes.values()):
            return min(k.num_blocks_override * k.block_size for k in shapes.values() if k.num_blocks_override)
        fit = int(available // per_token) if available > 0 and per_token else 0
        # Whole blocks in every cache; with equal block sizes every cache gets the same block count.
        while fit > 0 and sum((fit // k.block_size) * k.bytes_per_block for k in shapes.values()) > available:
            fit -= 1
        return fit

    @staticmethod
    def _blocks(k: KVShape, tokens: int) -> tuple[int, str]:
        if k.num_blocks_override:
            return k.num_blocks_override, "num_blocks"
        blocks = tokens // k.block_size
        if k.cap and blocks > k.max_useful_blocks:
            return k.max_useful_blocks, "max_num_seqs"
        return blocks, "budget"

    def _fixed_line(self) -> str:
        parts = []
        for label, attr in (("weights", "weights"), ("activation peak", "activation_peak"), ("non-torch", "non_torch")):
            vals = {s: getattr(m, attr) for s, m in self.measured.items()}
            total = sum(vals.values())
            detail = f" ({', '.join(f'{s} {fmt_bytes(v)}' for s, v in vals.items())})" if len(vals) > 1 else ""
            parts.append(f"{label} {fmt_bytes(total)}{detail}")
        return " - ".join(parts)

    def _check_plan(self, plan: MemoryPlan, shapes: dict[str, KVShape], available: int) -> None:
        services = plan.services
        kv_total = sum(p.kv_cache_bytes for p in services.values())
        need = {s: k.min_blocks * k.bytes_per_block for s, k in shapes.items()}
        short = [s for s in shapes if services[s].num_blocks < shapes[s].min_blocks]
        fixed = [s for s in short if shapes[s].num_blocks_override]
        if fixed:  # --num-blocks set the cache, not the budget: say so
            k = shapes[fixed[0]]
            raise MemoryBudgetError(too_few_blocks(k.num_blocks_override, k.block_size, k.max_model_len, fixed[0]))
        if short:
            max_len = max(k.max_model_len for k in shapes.values())
            needs = ", ".join(f"{s} {fmt_bytes(n)}" for s, n in need.items())
            raise MemoryBudgetError(
                f"memory budget {fmt_bytes(self.budget_bytes)} ({self.budget_source}) leaves {fmt_bytes(max(0, available))} "
                f"for the KV cache (budget {fmt_bytes(self.budget_bytes)} - {self._fixed_line()} = {fmt_bytes(available)}), "
                f"but one sequence of --max-model-len {max_len} tokens needs {fmt_bytes(sum(need.values()))}"
                + (f" ({needs})" if len(need) > 1 else "")
                + f"; the plan holds {min(services[s].max_tokens for s in shapes)} tokens. Raise --memory-budget or "
                "--memory-utilization, or lower --max-model-len or --max-num-seqs (the activation peak grows with both)."
            )
        if kv_total > max(0, available):
            raise MemoryBudgetError(
                f"--num-blocks asks for {fmt_bytes(kv_total)} of KV cache, but memory budget {fmt_bytes(self.budget_bytes)} "
                f"({self.budget_source}) leaves {fmt_bytes(max(0, available))} (budget - {self._fixed_line()}). "
                "Lower --num-blocks (0 sizes it from the budget) or raise --memory-budget."
            )
        used = sum(p.used_bytes for p in services.values())
        if used > self.free_at_start:
            raise MemoryBudgetError(
                f"the plan needs {fmt_bytes(used)} ({self._fixed_line()} + KV cache {fmt_bytes(kv_total)}), but only "
                f"{fmt_bytes(self.free_at_start)} of {fmt_bytes(self.total_bytes)} {self._device_word} was free at start-up. "
                "Lower --memory-budget or --memory-utilization, or free memory on the device."
            )
