"""Linear layers on the CPU: the kernel is chosen by the number of rows a call multiplies.

Vocabulary:
  rows    M, the token rows of one call: 1 for a decode step of one sequence, k+1 for verifying
          k drafts, B*(k+1) for a batch, a chunk length for prefill.
  dense   `F.linear` on the plain [out, in] weight (MKL's sgemm/gemv for fp32).
  packed  the same weight reordered once into oneDNN's blocked layout and multiplied with
          `mkldnn._linear_pointwise`; without the reorder, oneDNN would redo it on every call.

Why both: a decode step reads every weight once whatever M is, so verifying k+1 tokens should
cost about one step. MKL's fp32 gemv is the fastest kernel for one row, but from two rows on its
small-M GEMM takes about twice as long on an AVX2-only CPU (measured on an AMD EPYC: 1536x576,
M=1 95 us, M=2 169 us; the 49152x576 head 10.2 ms vs 22.6 ms), while the prepacked oneDNN kernel
stays nearly flat from 1 to 8 rows. In bf16 on an AMX CPU the packed kernel wins at every M (the
dense bf16 call reorders the weight per call). So each weight shape gets a `RowKernels` table,
rows -> kernel, and a Linear holds only the copies its table uses.

Policies (`SPECSPLIT_LINEAR_KERNEL`):
  auto    (default) time both kernels at load for each weight shape at the row counts the engine
          runs, cycling through every layer's weight of that shape so the timing streams weights
          from memory as a real step does, and keep the faster per row count.
  static  the rule the measurements on both CPU kinds seen here give, with no timing: fp32 dense
          for one row and packed from two; bf16 packed everywhere. Deterministic, so tests that
          compare two processes' logits use it.
  dense / packed   one kernel for every row count (A/B benchmarks).
`SPECSPLIT_CPU_PACK=0` is the older switch for `dense`.

Packed results equal `F.linear` within fp32 rounding (the same products, another summation
order); the tests check it. A packed tensor is opaque (no storage the memory profiler's tracker
sees), so `untracked_bytes` reports its size and the model adds it to its weights.
"""
from __future__ import annotations

import logging
import os
import statistics
import time
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

# A hint for the number of rows a call will see; 8 covers decode, verify (K+1) and small batches
# at full speed and stays within a few percent of the best layout for long prefill chunks.
ROWS_HINT = 8
ENV_SWITCH = "SPECSPLIT_CPU_PACK"  # "0" = dense only (kept for the earlier A/B scripts)
ENV_POLICY = "SPECSPLIT_LINEAR_KERNEL"  # auto | static | dense | packed
POLICIES = ("auto", "static", "dense", "packed")
DENSE, PACKED = "dense", "packed"
# Row counts timed by `auto`; a row count between two of them takes the choice of the next larger
# one; past the last, dense where the table keeps the dense copy (see RowKernels.kernel).
CALIBRATION_ROWS = (1, 2, 3, 4, 5, 6, 8, 12, 16)


def policy() -> str:
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return DENSE
    p = os.environ.get(ENV_POLICY, "auto").strip().lower()
    if p not in POLICIES:
        raise ValueError(f"{ENV_POLICY}={p!r}: choose one of {', '.join(POLICIES)}")
    return p


def supported(device: torch.device | str, dtype: torch.dtype) -> bool:
    """True where the packed kernel exists: CPU, fp32 or bf16 (bf16 needs AVX512-BF16/AMX or
    AVX-NE-CONVERT: oneDNN refuses to reorder bf16 weights on an AVX2-only CPU)."""
    if torch.device(device).type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] dense -> the same weight in oneDNN's blocked layout (opaque)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), ROWS_HINT)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, in] -> [M, out] through a packed weight."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


def untracked_bytes(shape: torch.Size, dtype: torch.dtype) -> int:
    """Bytes a packed weight of this dense shape holds (the blocked layout has no padding for the
    shapes Llama-family models use; counting the dense size is what the budget needs)."""
    return int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class RowKernels:
    """rows -> kernel for one weight shape. `by_rows[i]` is the kernel for CALIBRATION_ROWS[i]
    (or, for a table built without timing, `by_rows[0]` for one row and `by_rows[1]` above)."""

    rows: tuple[int, ...]
    by_rows: tuple[str, ...]
    timings_us: tuple[tuple[float, float], ...] = ()  # (dense, packed) per row count, auto only

    @classmethod
    def single(cls, kernel: str) -> "RowKernels":
        return cls((1,), (kernel,))

    def kernel(self, m: int) -> str:
        for r, k in zip(self.rows, self.by_rows):
            if m <= r:
                return k
        # Past the table (prefill chunks): dense where the dense copy is kept. MKL's GEMM is
        # efficient there, and oneDNN would build (and cache, with its scratchpad) one primitive
        # per distinct row count, memory the start-up profile cannot see.
        return DENSE if DENSE in self.by_rows else self.by_rows[-1]

    @property
    def uses(self) -> set[str]:
        return set(self.by_rows)

    def describe(self) -> str:
        """'dense 1, packed 2+' style summary."""
        parts, start = [], 1
        for i, (r, k) in enumerate(zip(self.rows, self.by_rows)):
            last = i == len(self.rows) - 1
            if last or self.by_rows[i + 1] != k:
                open_end = last and self.kernel(r + 1) == k
                parts.append(f"{k} {start}+" if open_end else (f"{k} {start}" if start == r else f"{k} {start}-{r}"))
                start = r + 1
        if self.kernel(self.rows[-1] + 1) != self.by_rows[-1]:
            parts.append(f"{self.kernel(self.rows[-1] + 1)} {self.rows[-1] + 1}+")
        return ", ".join(parts)


def static_table(dtype: torch.dtype) -> RowKernels:
    if dtype == torch.bfloat16:
        return RowKernels.single(PACKED)
    return RowKernels((1, CALIBRATION_ROWS[-1]), (DENSE, PACKED))


def _median_us(fn, calls: int) -> float:
    fn()  # warm-up (first-call allocations)
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def calibrate(
    dense: Sequence[torch.Tensor],  # every layer's [out, in] weight of one shape
    packed: Sequence[torch.Tensor],  # the same weights packed
    rows: Sequence[int] = CALIBRATION_ROWS,
    budget_s: float = 0.4,
) -> RowKernels:
    """Time both kernels at each row count and keep the faster. One sample is a pass over every
    weight of the shape (so weights come from memory, as in a step), repeated within `budget_s`
    per shape; the two kernels alternate sample by sample so drift hits both alike."""
    out_f, in_f = dense[0].shape
    dtype = dense[0].dtype
    g = torch.Generator().manual_seed(0)
    xs = {m: torch.randn(m, in_f, generator=g).to(dtype) for m in rows}

    def dense_pass(x):
        for w in dense:
            F.linear(x, w)

    def packed_pass(x):
        for w in packed:
            packed_linear(x, w, None)

    # Size the repetition count from one pass at the largest row count.
    t0 = time.perf_counter()
    dense_pass(xs[rows[-1]])
    packed_pass(xs[rows[-1]])
    per_pair = max(time.perf_counter() - t0, 1e-6)
    reps = int(max(3, min(25, budget_s / (per_pair * len(rows)))))
    timings = []
    for m in rows:
        x = xs[m]
        d, p = [], []
        dense_pass(x)
        packed_pass(x)
        for _ in range(reps):
            t = time.perf_counter()
            dense_pass(x)
            d.append(time.perf_counter() - t)
            t = time.perf_counter()
            packed_pass(x)
            p.append(time.perf_counter() - t)
        timings.append((1e6 * statistics.median(d) / len(dense), 1e6 * statistics.median(p) / len(packed)))
    return RowKernels(tuple(rows), crossover(timings), tuple((round(a, 1), round(b, 1)) for a, b in timings))


def crossover(timings: Sequence[tuple[float, float]]) -> tuple[str, ...]:
    """One switch point: dense below it, packed from it on (or one kernel throughout), the point
    that minimizes the summed time over the timed row counts. Single-row-count comparisons flip
    with timing noise; the kernels' costs are monotone in M, so one crossover is all there is."""
    n = len(timings)
    best = min(range(n + 1), key=lambda c: (sum(t[0] for t in timings[:c]) + sum(t[1] for t in timings[c:]), -c))
    return tuple(DENSE if i < best else PACKED for i in range(n))
