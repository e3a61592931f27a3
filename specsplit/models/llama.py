"""Native Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2) over the paged KV cache.

One forward takes a flat batch of new tokens (see attention.BatchMetadata) and returns logits only
at the requested positions. q/k/v and gate/up projections are fused into one matmul each at load
time (weights are concatenated once), which matters on CPUs where per-op overhead dominates.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from specsplit.config import ModelConfig
from specsplit.kernels import decode_ops, dispatch, layer_stack, quant_linear, skinny_linear
from specsplit.models import cpu_linear
from specsplit.kv import huge_pages
from specsplit.kv.paged_cache import PagedKVCache
from specsplit.models.attention import BatchMetadata, paged_attention, store_kv
from specsplit.models.lean_layer import LeanLayer
from specsplit.sampling.probs import greedy_ids

log = logging.getLogger(__name__)
# LeanLayer.rows where every linear runs the quantized kernel at any row count (weights in AMX
# tiles): a prefill chunk or a large batch takes the lean step too
LEAN_ANY_ROWS = 1 << 30


class Linear(nn.Linear):
    """nn.Linear that may also hold faster copies of its weight for the CPU (oneDNN-packed, or the
    skinny kernel's blocked layout) and a rows -> kernel table (see cpu_linear). The copies the
    table never uses are freed; `dense_weight()` rebuilds the dense weight on demand. A quantized
    Linear (`set_quant`, GGUF blocks) holds only its blocks: no dense weight, no other copy."""

    packed: torch.Tensor | None = None  # oneDNN blocked, opaque
    skinny: torch.Tensor | None = None  # [ceil(out/16), in, 16] for kernels/cpu/skinny_linear.cpp
    quant: quant_linear.QuantWeight | None = None  # GGUF blocks for kernels/cpu/quant_linear.cpp
    quant_blocks: torch.Tensor | None = None  # quant.blocks [out, in/32 * B] uint8, seen by the memory count
    kernels: cpu_linear.RowKernels | None = None  # None: dense, or packed-only when packed is set

    def reset_parameters(self) -> None:
        """No random init: every Linear here is filled from a checkpoint, a GGUF file or a given
        weight before use (models/loader.py raises on a missing tensor). nn.Linear's kaiming init
        of SmolLM2's 120 weights was 0.45 s of a 6.7 s model load, for memory freed unread."""

    def set_quant(self, w: quant_linear.QuantWeight) -> None:
        """Multiply with the blocks `w` from now on; the dense weight is freed (never filled)."""
        self.quant, self.quant_blocks = w, w.blocks
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype, device=self.weight.device), requires_grad=False)

    def make_copies(self, kinds: tuple[str, ...]) -> None:
        if cpu_linear.PACKED in kinds:
            self.packed = cpu_linear.pack(self.weight)
        if cpu_linear.SKINNY in kinds:
            self.skinny = skinny_linear.pack(self.weight)

    def keep(self, table: cpu_linear.RowKernels) -> int:
        """Use `table`; free the copies it never uses. Returns the packed (opaque) bytes kept."""
        self.kernels = table
        shape, dtype = self.weight.shape, self.weight.dtype
        if cpu_linear.SKINNY not in table.uses:
            self.skinny = None
        if cpu_linear.PACKED not in table.uses:
            self.packed = None
        if cpu_linear.DENSE not in table.uses and self.packed is not None:
            self.weight = nn.Parameter(torch.empty(0, dtype=dtype, device=self.weight.device), requires_grad=False)
        return cpu_linear.untracked_bytes(shape, dtype) if self.packed is not None else 0

    def dense_weight(self) -> torch.Tensor:  # [out, in]
        if self.quant is not None:
            return quant_linear.dequantize(self.quant)
        return self.weight if self.weight.numel() or self.packed is None else self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [M, in] -> [M, out]
        return cpu_linear.run(x, self.kernels, self.weight, self.packed, self.skinny, self.out_features, self.bias,
                              self.quant)


class _Head:
    """The LM head as the forward runs it: the matrix [V or vocab subset, hidden] and its copies,
    with its rows -> kernel table. Not a module: for a tied head the dense matrix IS the embedding,
    which must not appear twice in state_dict or the memory count."""

    def __init__(self, dense: torch.Tensor | None, owns_dense: bool, quant: quant_linear.QuantWeight | None = None):
        self.dense: torch.Tensor | None = dense
        self.owns_dense = owns_dense  # False: the tied embedding or lm_head's own weight
        self.quant = quant  # the quantized embedding's or lm_head's blocks (then dense is None)
        self.rows = quant.out_features if quant is not None else dense.shape[0]
        self.packed: torch.Tensor | None = None
        self.skinny: torch.Tensor | None = None
        self.kernels: cpu_linear.RowKernels | None = None
        # a Q8_0 head's copy for the greedy ids alone (kernels/quant_linear.greedy; None: none here)
        self.greedy_copy: quant_linear.GroupCopy | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, V or subset]
        return cpu_linear.run(x, self.kernels, self.dense, self.packed, self.skinny, self.rows, None, self.quant)

    def greedy(self, x: torch.Tensor) -> torch.Tensor | None:  # [N, hidden] -> [N] int64, or None
        """greedy_ids(self(x)) without most of the logits, where the greedy copy answers for N rows
        (the rows at which self(x) runs quant_linear's loop, whose bits the copy's exact rows repeat)."""
        if self.greedy_copy is None or cpu_linear.quant_kind(self.kernels, x.shape[0]) != cpu_linear.QUANT:
            return None
        return quant_linear.greedy(x, self.quant, self.greedy_copy)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, dim]
        if decode_ops.usable(x) and x.stride(-1) == 1:  # fp32 on the CPU: one call
            return decode_ops.load().rms_norm(x, self.weight, self.eps)
        # Normalise in fp32 like the reference implementation (one fused op), then cast back.
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim/2], with Llama 3 style scaling when the config asks for it."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = cfg.rope_scaling_dict
    if not scaling:
        return inv_freq.float()
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq.float()
    if kind == "linear":
        return (inv_freq / float(scaling["factor"])).float()
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled).float()
    raise ValueError(f"rope scaling type {kind!r} is not supported (default, linear, llama3 are)")


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE (as in HF Llama). `tables(positions)` is computed once per forward and
    shared by every layer; `apply` then costs a handful of ops per layer for q and k together."""

    def __init__(self, cfg: ModelConfig, max_positions: int, device):
        super().__init__()
        inv_freq = rope_inv_freq(cfg).to(device)
        t = torch.arange(max_positions, dtype=torch.float32, device=device)
        freqs = torch.outer(t, inv_freq)  # [P, D/2]
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos [T, 1, D], signed sin [T, 1, D]) in fp32.

        With rot(x) = cat(x2, x1) and signed sin = cat(-sin, sin), x*cos + rot(x)*sin equals HF's
        x*cos + rotate_half(x)*sin bit for bit (negation is exact)."""
        cos = self.cos[positions]  # [T, D/2]
        sin = self.sin[positions]
        return torch.cat((cos, cos), -1)[:, None, :], torch.cat((-sin, sin), -1)[:, None, :]

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [T, heads, D]; computed in fp32, returned in x's dtype
        if decode_ops.usable(x) and x.stride(2) == 1 and x.stride(1) == x.shape[2]:  # fp32 on the CPU: one call
            return decode_ops.load().rope(x, cos, sin)
        x32 = x.float()
        x1, x2 = x32.chunk(2, dim=-1)
        return (x32 * cos + torch.cat((x2, x1), dim=-1) * sin).to(x.dtype)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.apply(x, *self.tables(positions))


class DecoderLayer(nn.Module):
    # Attention over the paged cache; specsplit.models.deterministic swaps in a batch-invariant one.
    attention = staticmethod(paged_attention)

    def __init__(self, cfg: ModelConfig, dtype, device):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.q_size, self.kv_size = cfg.num_heads * d, cfg.num_kv_heads * d
        kw = dict(dtype=dtype, device=device)
        self.input_norm = RMSNorm(h, cfg.rms_norm_eps, dtype, device)
        self.qkv_proj = Linear(h, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias, **kw)
        self.o_proj = Linear(self.q_size, h, bias=False, **kw)
        self.post_attn_norm = RMSNorm(h, cfg.rms_norm_eps, dtype, device)
        self.gate_up_proj = Linear(h, 2 * cfg.intermediate_size, bias=False, **kw)
        self.down_proj = Linear(cfg.intermediate_size, h, bias=False, **kw)
        self.scale = d**-0.5

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        rope_tables: tuple[torch.Tensor, torch.Tensor],  # RotaryEmbedding.tables(meta.positions)
        meta: BatchMetadata,
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(self.input_norm(x))  # [T, q + 2kv]
        # q and k heads side by side get the same rotation: one rope for both
        qk = RotaryEmbedding.apply(
            qkv[:, : self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim), *rope_tables
        )  # [T, H + Hkv, D]
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        store_kv(k, v, k_cache, v_cache, meta)
        attn = self.attention(q, k_cache, v_cache, meta, self.scale)  # [T, H, D]
        x = x + self.o_proj(attn.reshape(t, self.q_size))
        gate_up = self.gate_up_proj(self.post_attn_norm(x))  # [T, 2I]
        if decode_ops.usable(gate_up) and gate_up.shape[1] % 16 == 0:  # fp32 on the CPU: one call
            return x + self.down_proj(decode_ops.load().silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return x + self.down_proj(F.silu(gate) * up)


class LlamaForCausalLM(nn.Module):
    """Decoder + LM head. `vocab_subset` restricts the head to some rows (a draft's FR-Spec head):
    logits outside the subset are -inf, so q is exactly 0 there."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device, max_positions: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype
        self.device = torch.device(device)
        kw = dict(dtype=dtype, device=device)
        # filled by the loader (or replaced by GGUF blocks): no random init (0.18 s for SmolLM2)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size, **kw))
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype, device) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False, **kw)
        self.rope = RotaryEmbedding(cfg, max_positions or cfg.max_position_embeddings, device)
        self.vocab_subset: torch.Tensor | None = None  # [N] int64 sorted token ids
        self._subset_head: torch.Tensor | None = None  # [N, hidden]
        self._head: _Head | None = None  # set by select_kernels(): the head with its kernel table
        self.kernel_tables: dict[str, cpu_linear.RowKernels] = {}  # "qkv 960x576" -> rows -> kernel
        self.head_skinny: torch.Tensor | None = None  # the head's skinny copy (counted as weights)
        self.untracked_weight_bytes = 0  # bytes of prepacked weights (opaque to storage tracking)
        # per layer, its step as direct kernel calls where select_kernels found every piece on the
        # CPU kernels (models/lean_layer.py); None: the modules run
        self.lean_layers: list[LeanLayer] | None = None
        # the same steps of all the layers in one compiled call (kernels/layer_stack.py); None: the
        # lean layers run one Python call each
        self.lean_stack = None
        self.requires_grad_(False)

    def select_kernels(self, policy: str | None = None) -> bool:
        """Choose each linear layer's and the head's CPU kernel by row count (see cpu_linear),
        making the weight copies the chosen kernels read. Quantized layers (GGUF blocks) get a
        quant / dequant table whatever the dense policy. A no-op off the CPU, for dense-only
        policies without quantized layers, or where no faster kernel exists. Returns whether any
        table was set."""
        if self._head is not None:
            return False
        policy = policy or cpu_linear.policy()
        kinds = cpu_linear.candidates(self.device, self.dtype, policy)
        groups: dict[str, list[Linear]] = {}  # dense weights by shape
        quant_groups: dict[str, list[Linear]] = {}  # quantized weights by shape and type
        names = {"qkv_proj": "qkv", "o_proj": "o", "gate_up_proj": "gate_up", "down_proj": "down"}
        for layer in self.layers:
            for attr, short in names.items():
                m = getattr(layer, attr)
                if m.quant is not None:
                    quant_groups.setdefault(f"{short} {m.out_features}x{m.in_features} {m.quant.qtype}", []).append(m)
                else:
                    groups.setdefault(f"{short} {m.out_features}x{m.in_features}", []).append(m)
        head = self._make_head()
        if not kinds and not quant_groups and head.quant is None:
            return False
        for name, ms in quant_groups.items():
            table = self._quant_table(policy, ms)
            self.kernel_tables[name] = table
            for m in ms:
                m.kernels = table
        total = 0
        if kinds:
            for ms in groups.values():
                for m in ms:
                    m.make_copies(kinds)
            for name, ms in groups.items():
                table = self._table(policy, kinds, ms)
                self.kernel_tables[name] = table
                total += sum(m.keep(table) for m in ms)
        if head.quant is not None:
            head.kernels = self._quant_table(policy, [head])
            copy = quant_linear.greedy_copy(head.quant)  # either layout: greedy takes tiles too
            if copy is not None:  # 30 MB read once a step: in huge pages, as the layers' blocks are
                copy = dataclasses.replace(copy, groups=huge_pages.into_huge_pages([copy.groups])[0])
            head.greedy_copy = copy
            self._keep_greedy_copy(copy)
            if copy is not None:
                if quant_linear.bound_uses_vnni():
                    loop = "AVX-512 VNNI loop"
                elif quant_linear.uses_vnni():  # quant_linear.bound_loop(): by default on AMD CPUs
                    loop = f"AVX2 int8 loop; {quant_linear.ENV_GREEDY_BOUND}=vnni runs VNNI"
                else:
                    loop = "AVX2 loop"
                log.info("greedy steps: the head's argmax from an int8 bound over its %.0f MB copy (%s), "
                         "then the candidate rows exactly", copy.nbytes / 2**20, loop)
            self.kernel_tables[f"head {head.rows}x{self.cfg.hidden_size} {head.quant.qtype}"] = head.kernels
        elif kinds:
            if cpu_linear.PACKED in kinds:
                head.packed = cpu_linear.pack(head.dense)
            if cpu_linear.SKINNY in kinds:
                head.skinny = skinny_linear.pack(head.dense)
            table = self._table(policy, kinds, [head])
            self.kernel_tables[f"head {head.rows}x{self.cfg.hidden_size}"] = table
            total += self._keep_head(head, table)
        self._head = head
        self.untracked_weight_bytes = total
        self.lean_layers = self._lean_layers()
        self.lean_stack = layer_stack.stack_of(self.lean_layers)
        self._warm_packed(groups, head)
        log.info("CPU linear kernels (%s, %s): %s", policy, str(self.dtype).replace("torch.", ""),
                 "; ".join(f"{n}: {t.describe()}" for n, t in self.kernel_tables.items()))
        return True

    def forget_kernels(self) -> None:
        """Drop the chosen head and kernel tables (tensor parallel shards dense weights, then
        chooses again for the shard's shapes)."""
        self._head = None
        self.kernel_tables = {}
        self.lean_layers = self.lean_stack = None
        self._keep_greedy_copy(None)

    def _keep_greedy_copy(self, copy: quant_linear.GroupCopy | None) -> None:
        """The head's greedy copy as buffers too (not saved): plain tensors, so the memory meters
        and tensor_storage_bytes see them (~the head's size again)."""
        self.register_buffer("greedy_head_groups", None if copy is None else copy.groups, persistent=False)
        self.register_buffer("greedy_head_cmax", None if copy is None else copy.cmax, persistent=False)

    def _lean_layers(self) -> list[LeanLayer] | None:
        """Each layer's step as direct kernel calls (models/lean_layer.py), for the row counts at
        which all its linears run the quantized kernel (every count where each table says quant
        throughout, as with AMX tiles: prefill chunks and large batches too, one stack call
        instead of the modules: a 500-token prefill 617 -> 549 ms on the AMX Xeon); None unless
        every layer qualifies: fp32 on
        the CPU with the C++ glue, plain Linears (not tensor-parallel or row-wise ones) on GGUF
        blocks, the paged attention (not --deterministic's)."""
        if self.device.type != "cpu" or self.dtype != torch.float32 or decode_ops.load() is None \
                or quant_linear.load() is None or self.cfg.head_dim % 8 or dispatch.use_triton(self.device):
            return None
        rows, every_count = cpu_linear.QUANT_ROWS, True
        for layer in self.layers:
            linears = (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
            if layer.attention is not paged_attention or layer.gate_up_proj.out_features % 16 \
                    or any(type(m) is not Linear or m.quant is None or m.kernels is None for m in linears):
                return None
            rows = min([rows] + [next((r - 1 for r in range(1, rows + 1) if m.kernels.kernel(r) != cpu_linear.QUANT),
                                      rows) for m in linears])
            every_count = every_count and all(m.kernels.uses == {cpu_linear.QUANT} for m in linears)
        if every_count:  # the quantized kernel at any row count (weights in tiles): prefill and large batches too
            rows = LEAN_ANY_ROWS
        return [LeanLayer(layer, rows) for layer in self.layers] if rows > 0 else None

    def wrap_head(self, wrap: Callable[[_Head], object]) -> None:
        """Replace the head by wrap(head): the chosen one, or the plain head where no kernels were
        chosen (--deterministic makes it row-wise, models/deterministic.py). The wrapper computes
        the logits its own way, so a greedy copy goes (greedy steps take the wrapper's argmax)."""
        head = self._head if self._head is not None else self._make_head()
        head.greedy_copy = None
        self._keep_greedy_copy(None)
        self._head = wrap(head)

    def _quant_table(self, policy: str, layers: list) -> cpu_linear.RowKernels:
        """quant / dequant by row count for quantized weights of one shape (Linears or the _Head):
        timed under `auto` at the row counts up to QUANT_ROWS (weights in tiles: and at
        TILES_PREFILL_ROWS, whose winner then serves every larger count), else the static split."""
        weights = [m.quant for m in layers]
        tiles = all(w.layout == "tiles" for w in weights)
        if policy != "auto":
            return cpu_linear.quant_static_table(tiles)
        bias = [getattr(m, "bias", None) for m in layers]

        def pass_of(kind: str):
            table = cpu_linear.RowKernels.single(kind)

            def run(x: torch.Tensor) -> None:
                for w, b in zip(weights, bias):
                    cpu_linear.run(x, table, None, None, None, w.out_features, b, w)
            return run

        rows = tuple(r for r in cpu_linear.CALIBRATION_ROWS if r <= cpu_linear.QUANT_ROWS)
        rows += (cpu_linear.TILES_PREFILL_ROWS,) if tiles else ()
        table = cpu_linear.calibrate((cpu_linear.QUANT, pass_of(cpu_linear.QUANT)),
                                     (cpu_linear.DEQUANT, pass_of(cpu_linear.DEQUANT)),
                                     weights[0].in_features, torch.float32, len(layers), rows, beyond=cpu_linear.DEQUANT)
        return dataclasses.replace(table, beyond=table.by_rows[-1]) if tiles else table

    def _keep_head(self, head: _Head, table: cpu_linear.RowKernels) -> int:
        """Free the head copies `table` never uses; returns the packed (opaque) bytes kept."""
        head.kernels = table
        if cpu_linear.SKINNY not in table.uses:
            head.skinny = None
        self.head_skinny = head.skinny  # a tensor attribute, so the memory count sees it
        if cpu_linear.PACKED not in table.uses:
            head.packed = None
            return 0
        if cpu_linear.DENSE not in table.uses:
            if self.lm_head is not None and not head.owns_dense:
                self.lm_head.packed = head.packed  # untied: lm_head keeps only the packed copy
                self.lm_head.keep(table)
                head.dense = None
            elif head.owns_dense:
                head.dense = None  # the draft's subset head: only the packed copy is used
                self._subset_head = None
        return cpu_linear.untracked_bytes((head.rows, self.cfg.hidden_size), self.dtype)

    def _warm_packed(self, groups: dict[str, list[Linear]], head: _Head) -> None:
        """Call every packed kernel once at each row count its table gives it: oneDNN builds and
        caches one primitive (with its scratchpad) per shape, and doing it now puts that memory
        inside the load the memory profiler measures instead of growing it while serving."""
        targets = [(ms[0].packed, ms[0].kernels, ms[0].in_features) for ms in groups.values() if ms[0].packed is not None]
        if head.packed is not None:
            targets.append((head.packed, head.kernels, self.cfg.hidden_size))
        for packed, table, in_features in targets:
            for m in range(1, cpu_linear.CALIBRATION_ROWS[-1] + 1):
                if table is None or table.kernel(m) == cpu_linear.PACKED:
                    cpu_linear.packed_linear(torch.zeros(m, in_features, dtype=self.dtype), packed, None)

    def _table(self, policy: str, kinds: tuple[str, ...], layers: list) -> cpu_linear.RowKernels:
        """The rows -> kernel table for one weight shape (`layers`: Linears or the _Head)."""
        if len(kinds) == 1:
            return cpu_linear.RowKernels.single(kinds[0])
        if policy == "static":
            return cpu_linear.static_table(self.dtype, cpu_linear.SKINNY in kinds)
        in_features = self.cfg.hidden_size if isinstance(layers[0], _Head) else layers[0].in_features

        # (dense, packed, skinny, out_features) of each weight, gathered once outside the timing
        copies = [(m.dense, m.packed, m.skinny, m.rows) if isinstance(m, _Head)
                  else (m.weight, m.packed, m.skinny, m.out_features) for m in layers]

        def pass_of(kind: str):
            table = cpu_linear.RowKernels.single(kind)

            def run(x: torch.Tensor) -> None:
                for dense, packed, skinny, out in copies:
                    cpu_linear.run(x, table, dense, packed, skinny, out, None)
            return run

        low, high = kinds
        rows = tuple(r for r in cpu_linear.CALIBRATION_ROWS if r <= cpu_linear.SKINNY_ROWS) if low == cpu_linear.SKINNY \
            else cpu_linear.CALIBRATION_ROWS
        return cpu_linear.calibrate((low, pass_of(low)), (high, pass_of(high)), in_features, self.dtype, len(layers),
                                    rows, beyond=cpu_linear.DENSE)

    def _make_head(self) -> _Head:
        if self._subset_head is not None:  # a draft's FR-Spec head: its own copy of some rows
            return _Head(self._subset_head, owns_dense=True)
        if self.lm_head is not None:
            if self.lm_head.quant is not None:
                return _Head(None, owns_dense=False, quant=self.lm_head.quant)
            return _Head(self.lm_head.weight, owns_dense=False)
        quant = getattr(self.embed_tokens, "quant", None)  # a GGUF embedding kept quantized (gguf_native)
        if quant is not None:
            return _Head(None, owns_dense=False, quant=quant)
        return _Head(self.embed_tokens.weight, owns_dense=False)  # tied: the embedding stays dense

    def set_vocab_subset(self, token_ids: torch.Tensor | None) -> None:
        if token_ids is None:
            self.vocab_subset = self._subset_head = None
            return
        if self._head is not None:
            raise RuntimeError("set the vocabulary subset before select_kernels()")
        ids = token_ids.to(device=self.device, dtype=torch.int64)
        self.vocab_subset = ids
        self._subset_head = self.head_weight()[ids].contiguous()

    def keep_head_rows(self, rows: torch.Tensor) -> None:
        """rows [N, hidden]: the head is these rows alone (a tensor-parallel rank's vocabulary
        shard; its logits are gathered by the caller). An untied head's full weight is freed."""
        self.lm_head = None
        self._subset_head = rows.contiguous()
        self.vocab_subset = None

    def head_weight(self) -> torch.Tensor:  # [V, hidden]
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.dense_weight()

    def _logits(self, x: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, V or subset] float32
        if self._head is not None:
            return self._head(x).float()
        head = self._subset_head if self._subset_head is not None else self.head_weight()
        return F.linear(x, head).float()

    def _stack_step(self, x: torch.Tensor, rope_tables, meta: BatchMetadata, kv: PagedKVCache,
                    capture: dict[int, torch.Tensor] | None) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        """The lean step of every layer through the compiled stack: one call, or one per stretch
        of layers up to each captured one."""
        n, begin = len(self.layers), 0
        args = (*rope_tables, meta.slot_mapping, meta.block_tables, meta.q_lens_t, meta.kv_lens_t, kv.data)
        for i in sorted(i for i in capture if 0 <= i < n) if capture else ():
            x = capture[i] = self.lean_stack.run(x, *args, begin, i + 1, meta.tree_mask)
            begin = i + 1
        return self.lean_stack.run(x, *args, begin, n, meta.tree_mask) if begin < n else x

    def _greedy_head(self, x: torch.Tensor) -> torch.Tensor | None:  # [N, hidden] -> [N] int64, or None
        if type(self._head) is not _Head or self.vocab_subset is not None:  # none, or wrapped (--deterministic)
            return None
        return self._head.greedy(x)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: BatchMetadata, kv: PagedKVCache,
                capture: dict[int, torch.Tensor] | None = None, greedy: bool = False) -> torch.Tensor:
        """input_ids [T] -> logits [N, V] float32 at meta.logits_index.

        greedy: return greedy_ids(logits) [N] int64 instead, the same ids, mostly without the
        logits where the head has a greedy copy (a Q8_0 head: kernels/quant_linear.greedy).

        capture: layer indices as keys; each gets that layer's output [T, hidden] (the residual
        stream after it, Hugging Face's hidden_states[i + 1]) for a feature drafter."""
        x = self.embed_tokens(input_ids)  # [T, hidden]
        rope_tables = self.rope.tables(meta.positions)
        lean = self.lean_layers
        if lean is not None and (x.shape[0] > lean[0].rows or meta.block_tables is None or not meta.kernel_attends):
            lean = None  # prefill-sized, or a tree too big for the C++ attention (the torch one): the modules
        if lean is not None and self.lean_stack is not None and isinstance(kv, PagedKVCache):
            x = self._stack_step(x, rope_tables, meta, kv, capture)
        else:
            for i, layer in enumerate(self.layers):
                k_cache, v_cache = kv.layer(i)
                if lean is not None:
                    x = lean[i](x, *rope_tables, meta, k_cache, v_cache)
                else:
                    x = layer(x, rope_tables, meta, k_cache, v_cache)
                if capture is not None and i in capture:
                    capture[i] = x
        x = self.norm(x[meta.logits_index])  # [N, hidden]
        if greedy:
            ids = self._greedy_head(x)
            return ids if ids is not None else greedy_ids(self._full_logits(x))
        return self._full_logits(x)

    def _full_logits(self, x: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, V] float32
        if self.vocab_subset is None:
            return self._logits(x)
        sub = self._logits(x)  # [N, subset]
        logits = torch.full((x.shape[0], self.cfg.vocab_size), float("-inf"), device=x.device)
        logits[:, self.vocab_subset] = sub
        return logits
