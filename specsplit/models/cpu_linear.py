"""Linear layers on the CPU: the kernel is chosen by the number of rows a call multiplies.

Vocabulary:
  rows    M, the token rows of one call: 1 for a decode step of one sequence, k+1 for verifying
          k drafts, B*(k+1) for a batch, a chunk length for prefill.
  dense   `F.linear` on the plain [out, in] weight (MKL's sgemm/gemv for fp32).
  packed  the same weight reordered once into oneDNN's blocked layout and multiplied with
          `mkldnn._linear_pointwise`; without the reorder, oneDNN would redo it on every call.
  quant   GGUF Q4_0/Q4_1/Q8_0 blocks kept as the file has them (`--weights native`), up to
          QUANT_ROWS rows: kernels/cpu/quant_linear.cpp dequantizes each block in registers and
          multiplies it with every row (fp32), reading the quantized bytes once per call.
  dequant the same blocks dequantized to a dense fp32 copy for the one call, then MKL's GEMM: the
          prefill-sized calls, where the GEMM's throughput beats the per-row kernel.
  skinny  fp32, up to SKINNY_ROWS rows: kernels/cpu/skinny_linear.cpp reads a blocked copy of the
          weight once for all rows (AVX2 + FMA, compiled on first use). The flat-cost kernel:
          whole SmolLM2-135M forward, 1 thread, verifying 2..5 tokens costs 1.05-1.15 one-token
          steps with it on both CPU kinds, and its one-row step is ~7% faster than MKL's gemv.

Why both: a decode step reads every weight once whatever M is, so verifying k+1 tokens should
cost about one step. MKL's fp32 gemv is the fastest kernel for one row, but from two rows on its
small-M GEMM takes about twice as long on an AVX2-only CPU (measured on an AMD EPYC: 1536x576,
M=1 95 us, M=2 169 us; the 49152x576 head 10.2 ms vs 22.6 ms), while the prepacked oneDNN kernel
stays nearly flat from 1 to 8 rows. In bf16 on an AMX CPU the packed kernel wins at every M (the
dense bf16 call reorders the weight per call). So each weight shape gets a `RowKernels` table,
rows -> kernel, and a Linear holds only the copies its table uses.

The candidates by dtype: fp32 with the skinny kernel available: skinny for few rows, dense
(MKL GEMM) for more; fp32 without it: dense for few rows, packed from the crossover on, dense for
prefill; bf16: packed at every M (AMX; an AVX2-only CPU cannot pack bf16: dense).

Policies (`SPECSPLIT_LINEAR_KERNEL`):
  auto    (default) time both candidates at load for each weight shape at the row counts the
          engine runs, cycling through every layer's weight of that shape so the timing streams
          weights from memory as a real step does, and switch kernels at the one row count that
          minimizes the summed time.
  static  the rule the measurements on both CPU kinds seen here give, with no timing: fp32 skinny
          for 1..8 rows (else dense for 1 row, packed for 2..16) and dense beyond; bf16 packed.
          Deterministic, so tests that compare two processes' logits use it.
  dense / packed   one kernel for every row count (A/B benchmarks).
`SPECSPLIT_CPU_PACK=0` is the older switch for `dense`.
A quantized weight has only its blocks: its table is quant / dequant, timed under `auto` (rows
1..QUANT_ROWS, one crossover), else quant for 1..QUANT_ROWS rows and dequant beyond. Weights in
the AMX tiles layout are timed at TILES_PREFILL_ROWS too, and that row count's winner serves every
row count past it: the AMX loop converts a block once per 16 tokens (5 before the twenty-third session), and at a prefill's row counts it
still beats dequantizing for MKL (measured on the Xeon: Q4_1 3072 x 576 at 64 rows 1.1 ms, against
2.2 ms for the dequantized GEMM and 2.1 ms more to dequantize the tiles); their static table is quant
throughout.

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
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from specsplit.kernels import quant_linear, skinny_linear

log = logging.getLogger(__name__)

# A hint for the number of rows a call will see; 8 covers decode, verify (K+1) and small batches
# at full speed and stays within a few percent of the best layout for long prefill chunks.
ROWS_HINT = 8
ENV_SWITCH = "SPECSPLIT_CPU_PACK"  # "0" = dense only (kept for the earlier A/B scripts)
ENV_POLICY = "SPECSPLIT_LINEAR_KERNEL"  # auto | static | dense | packed
POLICIES = ("auto", "static", "dense", "packed")
DENSE, PACKED, SKINNY = "dense", "packed", "skinny"
QUANT, DEQUANT = "quant", "dequant"  # a quantized weight's two kernels
SKINNY_ROWS = 8  # the skinny kernel's table; more rows (prefill) take MKL's GEMM
QUANT_ROWS = 16  # the quantized kernel's table; more rows (prefill) dequantize for MKL's GEMM
TILES_PREFILL_ROWS = 32  # weights in tiles: also timed here; its winner serves every larger count
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


def run(
    x: torch.Tensor,  # [M, in]
    table: "RowKernels | None",
    dense: torch.Tensor | None,  # [out, in]
    packed: torch.Tensor | None,  # oneDNN blocked (opaque)
    skinny: torch.Tensor | None,  # [ceil(out/16), in, 16]
    out_features: int,
    bias: torch.Tensor | None,
    quant: quant_linear.QuantWeight | None = None,  # GGUF blocks [out, in/32 * B] uint8
) -> torch.Tensor:  # [M, out]
    """One linear call with the kernel the table gives for M rows (no table: packed if there is
    a packed copy, else dense; a quantized weight: quant up to QUANT_ROWS rows, else dequant)."""
    if quant is not None:
        if quant_kind(table, x.shape[0]) == QUANT:
            return quant_linear.linear(x, quant, bias)
        return quant_linear.dequantized_linear(x, quant, bias)
    kind = table.kernel(x.shape[0]) if table is not None else (PACKED if packed is not None else DENSE)
    if kind == SKINNY:
        return skinny_linear.linear(x, skinny, out_features, bias)
    if kind == PACKED:
        return packed_linear(x, packed, bias)
    return F.linear(x, dense, bias)


def quant_kind(table: "RowKernels | None", rows: int) -> str:
    """The kernel `run` gives a quantized weight at `rows` rows: its table's, else quant up to
    QUANT_ROWS rows and dequant past them."""
    return table.kernel(rows) if table is not None else (QUANT if rows <= QUANT_ROWS else DEQUANT)


def candidates(device: torch.device | str, dtype: torch.dtype, policy: str) -> tuple[str, ...]:
    """The kernels worth a copy for this device, dtype and policy; () = dense only, nothing to do."""
    if policy == DENSE or not supported(device, dtype):
        return ()
    if dtype == torch.bfloat16 or policy == PACKED:
        return (PACKED,)
    if skinny_linear.load() is not None:
        return (SKINNY, DENSE)
    return (DENSE, PACKED)


def untracked_bytes(shape: torch.Size, dtype: torch.dtype) -> int:
    """Bytes a packed weight of this dense shape holds (the blocked layout has no padding for the
    shapes Llama-family models use; counting the dense size is what the budget needs)."""
    return int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class RowKernels:
    """rows -> kernel for one weight shape: `by_rows[i]` serves row counts up to `rows[i]` (and
    above `rows[i-1]`); `beyond` serves every row count past the last."""

    rows: tuple[int, ...]
    by_rows: tuple[str, ...]
    beyond: str
    timings_us: tuple[tuple[float, float], ...] = ()  # (low, high) candidate per row count, auto only

    @classmethod
    def single(cls, kernel: str) -> "RowKernels":
        return cls((1,), (kernel,), kernel)

    def kernel(self, m: int) -> str:
        for r, k in zip(self.rows, self.by_rows):
            if m <= r:
                return k
        return self.beyond

    @property
    def uses(self) -> set[str]:
        return set(self.by_rows) | {self.beyond}

    def describe(self) -> str:
        """'skinny 1-8, dense 9+' style summary."""
        spans: list[tuple[str, int, int | None]] = []  # (kernel, first row, last row or None)
        start = 1
        for r, k in list(zip(self.rows, self.by_rows)) + [(None, self.beyond)]:
            if spans and spans[-1][0] == k:
                spans[-1] = (k, spans[-1][1], r)
            else:
                spans.append((k, start, r))
            start = (r or 0) + 1
        return ", ".join(f"{k} {a}+" if b is None else (f"{k} {a}" if a == b else f"{k} {a}-{b}") for k, a, b in spans)


def static_table(dtype: torch.dtype, skinny: bool) -> RowKernels:
    if dtype == torch.bfloat16:
        return RowKernels.single(PACKED)
    if skinny:
        return RowKernels((SKINNY_ROWS,), (SKINNY,), DENSE)
    return RowKernels((1, CALIBRATION_ROWS[-1]), (DENSE, PACKED), DENSE)


def quant_static_table(tiles: bool = False) -> RowKernels:
    """quant up to QUANT_ROWS rows, dequant past them; weights in tiles: quant throughout."""
    return RowKernels((QUANT_ROWS,), (QUANT,), QUANT if tiles else DEQUANT)


def calibrate(
    low: tuple[str, Callable[[torch.Tensor], None]],  # (kernel, one pass over every weight of the shape)
    high: tuple[str, Callable[[torch.Tensor], None]],
    in_features: int,
    dtype: torch.dtype,
    num_weights: int,
    rows: Sequence[int],
    beyond: str,
    budget_s: float = 0.4,
) -> RowKernels:
    """Time both kernels at each row count; `low` serves the row counts below the crossover,
    `high` those from it on (see `crossover`). One sample is a pass over every weight of the shape
    (weights come from memory, as in a step), repeated within `budget_s` per shape; the two
    kernels alternate sample by sample so drift hits both alike."""
    g = torch.Generator().manual_seed(0)
    xs = {m: torch.randn(m, in_features, generator=g).to(dtype) for m in rows}
    (low_kind, low_pass), (high_kind, high_pass) = low, high
    t0 = time.perf_counter()
    low_pass(xs[rows[-1]])
    high_pass(xs[rows[-1]])
    per_pair = max(time.perf_counter() - t0, 1e-6)
    reps = int(max(3, min(25, budget_s / (per_pair * len(rows)))))
    timings = []
    for m in rows:
        x = xs[m]
        a, b = [], []
        low_pass(x)
        high_pass(x)
        for _ in range(reps):
            t = time.perf_counter()
            low_pass(x)
            a.append(time.perf_counter() - t)
            t = time.perf_counter()
            high_pass(x)
            b.append(time.perf_counter() - t)
        timings.append((1e6 * statistics.median(a) / num_weights, 1e6 * statistics.median(b) / num_weights))
    return RowKernels(tuple(rows), crossover(timings, low_kind, high_kind), beyond,
                      tuple((round(a, 1), round(b, 1)) for a, b in timings))


def crossover(timings: Sequence[tuple[float, float]], low: str = DENSE, high: str = PACKED) -> tuple[str, ...]:
    """One switch point: `low` below it, `high` from it on (or one kernel throughout), the point
    that minimizes the summed time over the timed row counts. Single-row-count comparisons flip
    with timing noise; the kernels' costs are monotone in M, so one crossover is all there is."""
    n = len(timings)
    best = min(range(n + 1), key=lambda c: (sum(t[0] for t in timings[:c]) + sum(t[1] for t in timings[c:]), -c))
    return tuple(low if i < best else high for i in range(n))
