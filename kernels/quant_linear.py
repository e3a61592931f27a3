"""Host side of kernels/cpu/quant_linear.cpp: a CPU linear over GGUF block-quantized weights
(Q4_0, Q4_1, Q8_0) that dequantizes each block in registers, so a decode or verify step reads the
file's bytes (Q4_1: 0.625 bytes per weight, 6.4x fewer than fp32) instead of a dequantized copy.

Lossless: the kernel multiplies fp32 activations with exactly the fp32 values gguf-py's (and so
transformers') dequantization gives, so y equals `reference` (dequantize, then F.linear) within
fp32 summation order.

The extension is compiled on first use with torch's cpp_extension (gcc and ninja; about 30 s once,
then loaded from torch's extension cache). `load()` returns None where it cannot be had: no
AVX2/FMA/F16C, no compiler, a failed build, or SPECSPLIT_QUANT=0; the loader then dequantizes the
weights to dense fp32 as before. The AVX-512 loop runs where the CPU has it (SPECSPLIT_QUANT_AVX512=0
keeps the AVX2 one).

Two layouts of the same bytes (`QuantWeight.layout`):
  rows   "split rows", one row of blocks per output feature (every CPU, every type)
  tiles  Q4_0 / Q4_1 / Q8_0 regrouped per 16 output features for the AMX tile unit (`to_tiles`; the C++
         file's AMX section says how). The loader picks it (`for_kernel`) where AMX-BF16 runs and
         SPECSPLIT_QUANT_AMX is not "0": the weights' conversion there is the same for 1 to 5
         token rows, so a verify costs about one decode row.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from specsplit.kernels.cpu_build import build, cpu_has, cpu_vendor


SOURCE = Path(__file__).resolve().parent / "cpu" / "quant_linear.cpp"
ENV_SWITCH = "SPECSPLIT_QUANT"  # "0": never build or use it
ENV_AVX512 = "SPECSPLIT_QUANT_AVX512"  # "0": the AVX2 loop even where AVX-512 exists
ENV_AMX = "SPECSPLIT_QUANT_AMX"  # "0": the rows layout even where AMX runs
ENV_GREEDY = "SPECSPLIT_QUANT_GREEDY"  # "0": no greedy copy of a Q8_0 head (greedy steps compute the logits)
# the greedy bound pass's loop where VNNI runs: "vnni", "avx2", or "auto" (bound_loop())
ENV_GREEDY_BOUND = "SPECSPLIT_QUANT_GREEDY_BOUND"
GREEDY_BOUND_LOOPS = ("auto", "vnni", "avx2")
TILE_ROWS = 16  # output features per group of the tiles layout
TILE_TYPES = ("Q4_0", "Q4_1", "Q8_0")  # the types the AMX loop runs
BLOCK = 32  # weights per block
GREEDY_MAX_ROWS = 3  # greedy(): kernels/cpu/quant_linear.cpp's GREEDY_MAX_ROWS
GREEDY_MAX_ROWS_TILES = 5  # greedy() of a head in tiles: its GREEDY_MAX_ROWS_TILES (the AMX loop's one pass)
# name -> (ggml type id, bytes per block of 32 weights)
TYPES: dict[str, tuple[int, int]] = {"Q4_0": (2, 18), "Q4_1": (3, 20), "Q8_0": (8, 34)}
SCALE_BYTES = {"Q4_0": 2, "Q4_1": 4, "Q8_0": 2}  # the fp16 d (and m) at the start of a file block
_lock = threading.Lock()
_module = None
_tried = False
_avx512 = True  # SPECSPLIT_QUANT_AVX512, read once by load() (a decode step makes ~120 calls)
_bound_vnni = True  # bound_loop() == "vnni", set by load()


@dataclass
class QuantWeight:
    """One weight [out, in] as GGUF blocks, row n holding the in/32 blocks of output feature n in
    "split rows": the same bytes as the file, regrouped per row as all the blocks' quants, then
    all their fp16 scales (the kernel converts a row's scales in a few vector instructions).
    `from_gguf` makes one from the file's layout, `gguf_blocks` gives that layout back.
    layout "tiles" (`to_tiles`, `as_rows` back): the same bytes per group of 16 output features
    for the AMX loop, blocks [out/16, in/32 * 16 * block bytes]."""

    blocks: torch.Tensor  # [out, in/32 * block bytes] uint8, split rows (tiles: [out/16, ...])
    qtype: str  # "Q4_0" | "Q4_1" | "Q8_0"
    in_features: int
    layout: str = "rows"  # "rows" | "tiles"

    @classmethod
    def from_gguf(cls, blocks: torch.Tensor, qtype: str, in_features: int) -> "QuantWeight":
        """blocks [out, in/32 * B] uint8 in the file's layout (scales, then quants, block by block)."""
        if qtype not in TYPES:
            raise ValueError(f"quantized type {qtype!r}: the kernel runs {', '.join(TYPES)}")
        n, nb, size, sb = blocks.shape[0], in_features // BLOCK, TYPES[qtype][1], SCALE_BYTES[qtype]
        b = blocks.reshape(n, nb, size)  # [N, nb, B]
        split = torch.cat([b[..., sb:].reshape(n, nb * (size - sb)), b[..., :sb].reshape(n, nb * sb)], dim=1)
        return cls(split.contiguous(), qtype, in_features)

    def gguf_blocks(self) -> torch.Tensor:  # [out, in/32 * B] uint8, the file's layout
        if self.layout == "tiles":
            return self.as_rows().gguf_blocks()
        n, nb, size, sb = self.out_features, self.in_features // BLOCK, TYPES[self.qtype][1], SCALE_BYTES[self.qtype]
        qs = self.blocks[:, : nb * (size - sb)].reshape(n, nb, size - sb)
        scales = self.blocks[:, nb * (size - sb):].reshape(n, nb, sb)
        return torch.cat([scales, qs], dim=-1).reshape(n, nb * size)

    def __post_init__(self):
        if self.qtype not in TYPES:
            raise ValueError(f"quantized type {self.qtype!r}: the kernel runs {', '.join(TYPES)}")
        if self.layout not in ("rows", "tiles") or (self.layout == "tiles" and self.qtype not in TILE_TYPES):
            raise ValueError(f"layout {self.layout!r} for {self.qtype}: rows, or tiles for {', '.join(TILE_TYPES)}")
        per_row = self.in_features // BLOCK * TYPES[self.qtype][1] * (TILE_ROWS if self.layout == "tiles" else 1)
        if self.in_features % BLOCK or self.blocks.shape[1] != per_row:
            raise ValueError(f"{self.qtype} blocks {tuple(self.blocks.shape)} do not hold {self.layout} of "
                             f"{self.in_features} weights")

    @property
    def out_features(self) -> int:
        return self.blocks.shape[0] * (TILE_ROWS if self.layout == "tiles" else 1)

    def tileable(self) -> bool:
        """Whether the tiles layout can hold this weight: out a multiple of 16, in of 64."""
        return self.qtype in TILE_TYPES and self.out_features % TILE_ROWS == 0 and self.in_features % (2 * BLOCK) == 0

    def to_tiles(self) -> "QuantWeight":
        """The same bytes in the tiles layout (kernels/cpu/quant_linear.cpp, its AMX section): per
        group of 16 output features and block, the quants in the tile unit's pair order (4-bit: 256
        bytes of nibbles, four tile rows per 16-bit word; Q8_0: 512 bytes), then the 16 fp16 d (then
        the 16 fp16 m)."""
        if self.layout == "tiles":
            return self
        if not self.tileable():
            raise ValueError(f"{self.qtype} {self.out_features}x{self.in_features} does not fit the tiles layout")
        n, nb, size, sb = self.out_features, self.in_features // BLOCK, TYPES[self.qtype][1], SCALE_BYTES[self.qtype]
        g = n // TILE_ROWS
        b = self.gguf_blocks().view(n, nb, size)  # [N, nb, B]
        qs = b[..., sb:]  # [N, nb, 16]: byte j holds weight j (low nibble) and j + 16 (high); Q8_0 [N, nb, 32]
        q = qs if self.qtype == "Q8_0" else torch.cat([qs & 0x0F, qs >> 4], dim=-1)  # [N, nb, 32]
        # tile row i, entry j = 2n + p: the quant of feature n at k = 2i + p
        tile = q.view(g, TILE_ROWS, nb, 16, 2).permute(0, 2, 3, 1, 4).reshape(g, nb, 16, 32)
        if self.qtype == "Q8_0":
            parts = [tile.reshape(g, nb, 512)]
        else:
            t4 = tile.view(g, nb, 4, 4, 32)  # [G, nb, a, c, j]: tile row 4a + c
            # chunk c = 32 little-endian words, word j = entry j of rows c, c+4, c+8, c+12 in nibbles 0..3
            words = torch.stack([t4[:, :, 0] | (t4[:, :, 1] << 4), t4[:, :, 2] | (t4[:, :, 3] << 4)], dim=-1)
            parts = [words.reshape(g, nb, 256)]  # [G, nb, c, j, byte] -> 256 bytes
        for half in range(sb // 2):  # d, then m: [G, nb, 16 x 2 bytes]
            parts.append(b[..., 2 * half:2 * half + 2].reshape(g, TILE_ROWS, nb, 2).permute(0, 2, 1, 3).reshape(g, nb, 32))
        tiles = torch.cat(parts, dim=-1).reshape(g, -1).contiguous()
        return QuantWeight(tiles, self.qtype, self.in_features, "tiles")

    def as_rows(self) -> "QuantWeight":
        """The same bytes in the rows layout (the inverse of `to_tiles`)."""
        if self.layout == "rows":
            return self
        n, nb, sb = self.out_features, self.in_features // BLOCK, SCALE_BYTES[self.qtype]
        g, qb = n // TILE_ROWS, 512 if self.qtype == "Q8_0" else 256
        t = self.blocks.view(g, nb, TILE_ROWS * TYPES[self.qtype][1])  # [G, nb, 16 x the file block bytes]
        if self.qtype == "Q8_0":
            tile = t[..., :512].reshape(g, nb, 16, 32)  # [G, nb, 16 (i), 32 (j)]
        else:
            words = t[..., :256].reshape(g, nb, 4, 32, 2)  # [G, nb, c, j, byte]
            lo, hi = words[..., 0], words[..., 1]
            tile = torch.stack([lo & 0x0F, lo >> 4, hi & 0x0F, hi >> 4], dim=2).reshape(g, nb, 16, 32)  # row 4a + c
        q = tile.view(g, nb, 16, TILE_ROWS, 2).permute(0, 3, 1, 2, 4).reshape(n, nb, 32)  # [N, nb, 32]
        qs = q if self.qtype == "Q8_0" else q[..., :16] | (q[..., 16:] << 4)  # [N, nb, 32 or 16]
        scales = [t[..., qb + 32 * h:qb + 32 + 32 * h].reshape(g, nb, TILE_ROWS, 2).permute(0, 2, 1, 3).reshape(n, nb, 2)
                  for h in range(sb // 2)]
        blocks = torch.cat(scales + [qs], dim=-1).reshape(n, nb * TYPES[self.qtype][1])  # the file's layout
        return QuantWeight.from_gguf(blocks.contiguous(), self.qtype, self.in_features)

    def slice_rows(self, a: int, b: int) -> "QuantWeight":
        """Output features a..b as a view (tiles: a and b multiples of 16, or b the end)."""
        if self.layout == "rows":
            return QuantWeight(self.blocks[a:b], self.qtype, self.in_features)
        if a % TILE_ROWS or (b % TILE_ROWS and b < self.out_features):
            raise ValueError(f"tiles hold groups of {TILE_ROWS} output features; rows {a}..{b} split one")
        return QuantWeight(self.blocks[a // TILE_ROWS:-(-b // TILE_ROWS)], self.qtype, self.in_features, "tiles")

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def rows(self, index: torch.Tensor) -> "QuantWeight":
        """The output rows `index` [R] (a permutation, a subset): whole rows of blocks, exact
        (rows layout; from tiles, gathered from their groups: an embedding lookup's few rows)."""
        if self.layout != "rows":
            group = QuantWeight(self.blocks[index // TILE_ROWS].reshape(-1, self.blocks.shape[1]), self.qtype,
                                self.in_features, "tiles").as_rows()  # [16R, ...]: each row's whole group
            return group.rows(torch.arange(index.numel()) * TILE_ROWS + index % TILE_ROWS)
        return QuantWeight(self.blocks[index].contiguous(), self.qtype, self.in_features)

    @staticmethod
    def cat(parts: list["QuantWeight"]) -> "QuantWeight":
        """Stack weights of one type along the output rows (fused qkv, gate_up)."""
        parts = [p.as_rows() for p in parts]
        types = {p.qtype for p in parts}
        if len(types) != 1 or len({p.in_features for p in parts}) != 1:
            raise ValueError(f"cannot fuse weights of types {sorted(types)} / different in_features")
        return QuantWeight(torch.cat([p.blocks for p in parts]).contiguous(), parts[0].qtype, parts[0].in_features)


def cpu_supports() -> bool:
    """AVX2, FMA and F16C on this CPU."""
    return cpu_has("avx2", "fma", "f16c")


def load():
    """The compiled extension, or None (logged once) where it cannot be had."""
    global _module, _tried, _avx512, _bound_vnni
    if _tried:  # the per-call path: no lock
        return _module
    with _lock:
        if _tried:
            return _module
        _bound_vnni = bound_loop() == "vnni"  # before _tried: a bad value is refused at every call, by name
        _tried = True
        _avx512 = os.environ.get(ENV_AVX512, "1") != "0"
        if os.environ.get(ENV_SWITCH, "1") == "0" or not cpu_supports():
            return None
        _module = build("specsplit_quant_linear", SOURCE, ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off"],
                        "quantized linear kernel", "GGUF weights are dequantized to fp32")
        return _module


def avx512_allowed() -> bool:
    """SPECSPLIT_QUANT_AVX512 as the calls pass it (`bind` fixes it; the kernel also asks the CPU)."""
    load()
    return _avx512


def uses_avx512() -> bool:
    m = load()
    return bool(m is not None and _avx512 and m.quant_uses_avx512())


def uses_amx() -> bool:
    """Whether the AMX loop runs here: the extension, AMX-BF16 (flags and the kernel's permission),
    SPECSPLIT_QUANT_AMX not "0", and SPECSPLIT_QUANT_AVX512 not "0" (the loop is AVX-512 code too;
    an AVX2 stand-in run switches both off)."""
    m = load()
    return bool(m is not None and _avx512 and os.environ.get(ENV_AMX, "1") != "0" and m.quant_uses_amx())


def for_kernel(w: QuantWeight) -> QuantWeight:
    """The layout the fastest loop here reads: tiles where the AMX loop runs and the weight fits
    it (the loader calls this once per weight), else `w` as it is."""
    return w.to_tiles() if w.layout == "rows" and w.tileable() and uses_amx() else w


def linear(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None, avx512: bool | None = None) -> torch.Tensor:
    """x [M, in] fp32 -> [M, out] fp32; equal to `reference` within fp32 rounding (rows: summation
    order; tiles: also the factored d * sum(x q) + m * sum(x)).
    avx512=False runs the AVX2 loop (None: the AVX-512 one where the CPU has it); tiles run on AMX."""
    if w.layout == "tiles":
        return load().quant_linear_amx(x, w.blocks, TYPES[w.qtype][0], bias)
    return load().quant_linear(x, w.blocks, TYPES[w.qtype][0], bias, _avx512 if avx512 is None else avx512)


@dataclass(frozen=True)
class GroupCopy:
    """A Q8_0 weight's copy for the int8 loops (`greedy`, `int8_linear`): 16 output rows
    interleaved 4 bytes at a time (one VPDPBUSD reads 4 weights of 16 rows), and each row's largest
    block sum of |q| (greedy's bound)."""

    groups: torch.Tensor  # [ceil(out/16), in/32 * 544] uint8
    cmax: torch.Tensor  # [out] fp32

    @property
    def nbytes(self) -> int:
        return self.groups.numel() + 4 * self.cmax.numel()


def uses_vnni() -> bool:
    """Whether the AVX-512 VNNI loops (`greedy`, `int8_linear`) run here (else their AVX2 loops):
    the extension, the CPU's flags and SPECSPLIT_QUANT_AVX512 not "0"."""
    m = load()
    return m is not None and _avx512 and bool(m.quant_uses_vnni())


def bound_uses_vnni() -> bool:
    """Whether greedy()'s bound pass runs the VNNI loop here: VNNI runs, and load() took bound_loop()
    as "vnni" (else the AVX2 int8 loop)."""
    return uses_vnni() and _bound_vnni


def bound_loop() -> str:
    """The loop of greedy()'s bound pass where AVX-512 VNNI runs: "vnni", or "avx2" (the AVX2 int8
    loop: the same integer dot products, so the same bound, the same candidates and the same ids).
    SPECSPLIT_QUANT_GREEDY_BOUND picks one; "auto" (the default) takes the AVX2 loop on AMD CPUs and
    VNNI elsewhere. Measured on an AMD EPYC Zen 4 (one thread, SmolLM2's 29 MB copy read once a
    step, docs/kernels.md): the VNNI loop 1.35 ms a call against 1.10 ms for the AVX2 one when the
    layers have just streamed through the caches (0.88 / 0.85 ms hot), and served batch-1 decode 2-8%
    faster with the AVX2 loop. Intel's CPUs keep the VNNI loop, which is what they were measured with."""
    chosen = os.environ.get(ENV_GREEDY_BOUND, "auto").strip().lower() or "auto"
    if chosen not in GREEDY_BOUND_LOOPS:
        raise ValueError(f"{ENV_GREEDY_BOUND}={chosen!r}: use one of {', '.join(GREEDY_BOUND_LOOPS)}")
    if chosen == "auto":
        return "avx2" if cpu_vendor() == "AuthenticAMD" else "vnni"
    return chosen


def group_copy(w: QuantWeight) -> GroupCopy | None:
    """The 16-row copy of a Q8_0 weight (about its own size again) that `int8_linear` reads, or
    None (not Q8_0, or no extension)."""
    m = load()
    if w.qtype != "Q8_0" or m is None:
        return None
    return GroupCopy(*m.quant_greedy_pack(w.as_rows().blocks, TYPES[w.qtype][0], w.in_features))


def greedy_copy(w: QuantWeight) -> GroupCopy | None:
    """The copy `greedy` reads (group_copy), or None where `greedy` cannot run: see group_copy, or
    SPECSPLIT_QUANT_GREEDY=0. Every CPU the extension runs on (AVX2) has a bound loop."""
    return None if os.environ.get(ENV_GREEDY, "1") == "0" else group_copy(w)


def int8_linear(x: torch.Tensor, copy: GroupCopy, bias: torch.Tensor | None = None,
                avx512: bool | None = None) -> torch.Tensor:
    """x [M, in] fp32 -> [M, out] fp32: x @ W^T with x rounded to int8 per block of 32 (s =
    max|x_b| / 127), the int8 products exact, from W's `copy` (group_copy(w)). Not `linear`'s
    function: each output moves by up to greedy's bound e from it (measured 0.06-0.3% of the
    largest sum |w x| on random weights), so it is for a drafter, whose numbers only choose what is
    proposed. A row of x that is not finite gives NaN. The VNNI loop where uses_vnni(), else the
    AVX2 one (avx512=False forces it): the same y, bit for bit."""
    return load().quant_int8_linear(x, copy.groups, copy.cmax.numel(), bias, _avx512 if avx512 is None else avx512)


def greedy(x: torch.Tensor, w: QuantWeight, copy: GroupCopy, avx512: bool | None = None,
           bound: str | None = None) -> torch.Tensor | None:
    """x [M, in] fp32 -> [M] int64: the argmax of each row of `linear(x, w, avx512=avx512)`, the very
    ids `linear(x, w).max(dim=-1).indices` gives, mostly without computing that product: an int8
    bound read from `copy` (greedy_copy(w)) picks the rows that may hold a row's maximum and only
    those are computed exactly (kernels/cpu/quant_linear.cpp, "The greedy token of a Q8_0 head").
    The bound pass runs the VNNI loop where uses_vnni(), else the AVX2 one (avx512=False forces it,
    and the AVX2 loop of `linear` for the exact rows); bound "vnni" or "avx2" picks the bound pass's
    loop where VNNI runs (default: bound_loop(), read once by load()). None where it cannot answer (not a Q8_0
    weight, M > 3 (tiles: M > 5), or the bound too loose): the caller computes the logits. A head
    in the tiles layout takes its candidates' groups through the AMX loop `linear` runs on it
    (avx512 is then ignored: the tiles run only where AMX and AVX-512 do)."""
    if w.qtype != "Q8_0" or not 1 <= x.shape[0] <= (GREEDY_MAX_ROWS_TILES if w.layout == "tiles" else GREEDY_MAX_ROWS):
        return None
    if w.layout == "tiles":
        ids = load().quant_greedy_amx(x, w.blocks, TYPES[w.qtype][0], copy.groups, copy.cmax)
    else:
        ids = load().quant_greedy(x, w.blocks, TYPES[w.qtype][0], copy.groups, copy.cmax,
                                  _avx512 if avx512 is None else avx512,
                                  _bound_vnni if bound is None else bound == "vnni")
    return ids if ids.numel() else None


def bind(w: QuantWeight, bias: torch.Tensor | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """`linear(x, w, bias)` with everything but x fixed, for a hot loop (models/lean_layer.py):
    the same compiled call with the same arguments. Needs the extension (load() not None)."""
    blocks, code = w.blocks, TYPES[w.qtype][0]
    if w.layout == "tiles":
        fn_amx = load().quant_linear_amx
        return lambda x: fn_amx(x, blocks, code, bias)
    fn, avx512 = load().quant_linear, _avx512
    return lambda x: fn(x, blocks, code, bias, avx512)


def dequantize(w: QuantWeight) -> torch.Tensor:
    """[out, in] fp32: the kernel's values (the compiled loop where built, else the torch one)."""
    m = load()
    if m is None:
        return reference_dequantize(w)
    if w.layout == "tiles":
        return m.quant_dequantize_amx(w.blocks, TYPES[w.qtype][0], w.in_features)
    return m.quant_dequantize(w.blocks, TYPES[w.qtype][0], w.in_features)


def dequantize_rows(w: QuantWeight, ids: torch.Tensor) -> torch.Tensor:
    """[R, in] fp32: rows `ids` [R] of `w` dequantized (an embedding lookup), one compiled call
    for either layout. From tiles the gather reads each row from its group (4.6 us for one row,
    where converting its group back to rows in torch took ~100 us)."""
    m = load()
    if m is None:
        return dequantize(w.rows(ids.reshape(-1)))
    if w.layout == "tiles":
        return m.quant_dequantize_amx_rows(w.blocks, TYPES[w.qtype][0], w.in_features, ids.reshape(-1).long())
    return m.quant_dequantize_rows(w.blocks, TYPES[w.qtype][0], w.in_features, ids.reshape(-1).long())


# The dense copy is made a slice of output rows at a time, each at most this many bytes: the
# allocator then reuses one slice's memory for the next (and the next call's), where a whole
# 49152 x 576 head (113 MB, past glibc's mmap threshold) was mapped and page-faulted anew on
# every call. Measured (AMD EPYC, 1 thread): the head at 24 rows 84 ms -> 33 ms.
DEQUANT_CHUNK_BYTES = 8 << 20


def dequantized_linear(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None,
                       chunk_bytes: int = DEQUANT_CHUNK_BYTES) -> torch.Tensor:
    """x [M, in] -> [M, out] through dense fp32 copies of the weight made for this call, a slice
    of output rows at a time (prefill-sized M: MKL's GEMM then beats the per-row kernel; the
    copies cost ~1/M of the GEMM)."""
    step = max(1, chunk_bytes // (4 * w.in_features))  # output rows per slice
    if w.layout == "tiles":
        step = max(TILE_ROWS, step // TILE_ROWS * TILE_ROWS)  # whole groups
    if w.out_features <= step:
        return F.linear(x, dequantize(w), bias)
    out = torch.empty(x.shape[0], w.out_features, dtype=torch.float32, device=x.device)  # [M, out]
    for a in range(0, w.out_features, step):
        part = w.slice_rows(a, min(a + step, w.out_features))  # whole rows of blocks, a view
        out[:, a:a + part.out_features] = F.linear(x, dequantize(part), None if bias is None else bias[a:a + step])
    return out


def reference_dequantize(w: QuantWeight) -> torch.Tensor:
    """[out, in] fp32 in torch, the arithmetic of gguf-py's dequantize_blocks."""
    w = w.as_rows()
    n, nb = w.out_features, w.in_features // BLOCK
    b = w.gguf_blocks().view(n, nb, TYPES[w.qtype][1])  # [N, nb, B]
    d = b[..., :2].contiguous().view(torch.float16).float()  # [N, nb, 1]
    if w.qtype == "Q8_0":
        q = b[..., 2:].contiguous().view(torch.int8).float()  # [N, nb, 32]
        return (d * q).reshape(n, w.in_features)
    qs = b[..., 4:] if w.qtype == "Q4_1" else b[..., 2:]  # [N, nb, 16]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).float()  # [N, nb, 32]: low nibbles are weights 0..15
    if w.qtype == "Q4_0":
        return (d * (q - 8)).reshape(n, w.in_features)
    m = b[..., 2:4].contiguous().view(torch.float16).float()
    return (d * q + m).reshape(n, w.in_features)


def quantize_q8_0(w: torch.Tensor) -> QuantWeight:
    """w [out, in] (in a multiple of 32) -> Q8_0 blocks as llama.cpp makes them: per 32 weights an
    fp16 d = max|w| / 127 and int8 q = round(w / d). Rows that are already Q8_0 values (a GGUF
    file's Q8_0 tensor, dequantized) come back as the same blocks."""
    n, k = w.shape
    if k % BLOCK:
        raise ValueError(f"Q8_0 needs rows of a multiple of {BLOCK} weights, got {k}")
    b = w.detach().float().reshape(n, k // BLOCK, BLOCK)  # [N, nb, 32]
    d = (b.abs().amax(-1, keepdim=True) / 127).half()  # [N, nb, 1]
    inv = torch.where(d.float() > 0, 1.0 / d.float(), torch.zeros(()))
    q = torch.round(b * inv).clamp(-127, 127).to(torch.int8)
    blocks = torch.cat([d.view(torch.uint8).reshape(n, -1, 2), q.view(torch.uint8)], dim=-1)  # [N, nb, 34]
    return QuantWeight.from_gguf(blocks.reshape(n, -1).contiguous(), "Q8_0", k)


def reference(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, reference_dequantize(w), bias)
