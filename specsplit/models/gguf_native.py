"""GGUF weights at their own width: the model's linear layers and embedding keep the file's
Q4_0 / Q4_1 / Q8_0 blocks and multiply through kernels/quant_linear (dequantized in registers),
instead of a dequantized fp32 copy (`--weights native`, the default for GGUF models).

Tensors are read straight from the file (models/gguf_header.py: memory-mapped, then copied by
torch, so the memory profiler counts them as weights).
Two things make them the model's layout:
  * llama.cpp's converter permutes the rows of q and k of "llama"-architecture files (Llama,
    SmolLM2, Mistral: per head, the rotary halves interleaved); transformers undoes it when it
    dequantizes (reverse_permute; not for qwen2, which the converter leaves alone). Rows are
    independent, so the same permutation applied to whole rows of blocks is exact.
  * the model fuses q|k|v and gate|up into one matmul each: their rows of blocks are concatenated
    (only when the parts share one block type).
Other block types (F32, F16, K-quants) are left to the dense path, which is loaded as before.
Then, for the kernels: where the AMX loop runs, each weight the head or a linear multiplies with
is regrouped into the tiles layout (`quant_linear.for_kernel`), and every kept block is copied
into one buffer in transparent huge pages (kv/huge_pages.py), in the order a step reads them.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from specsplit.config import ModelConfig
from specsplit.kernels import quant_linear
from specsplit.kernels.quant_linear import QuantWeight
from specsplit.models.gguf_header import GGUFHeader
from specsplit.kv import huge_pages

log = logging.getLogger(__name__)

WEIGHT_MODES = ("native", "fp32", "bf16")


def reverse_permute_rows(rows: int, n_head: int) -> torch.Tensor:
    """[rows] int64: row i of the model's q (or k) weight is row index[i] of the GGUF tensor.

    The inverse of llama.cpp's permute(w, n_head) = w.reshape(n_head, 2, rows/n_head/2, ...)
    .swapaxes(1, 2), written as transformers' _reverse_permute_weights on the row indices."""
    dim = rows // n_head // 2
    return torch.arange(rows).reshape(n_head, dim, 2).transpose(1, 2).reshape(rows)


class QuantEmbedding(nn.Module):
    """nn.Embedding over quantized rows: a lookup dequantizes only the rows it reads."""

    def __init__(self, weight: QuantWeight):
        super().__init__()
        self.register_buffer("blocks", weight.blocks, persistent=False)  # [V, hidden/32 * B] uint8
        self.set_quant(weight)
        self.num_embeddings, self.embedding_dim = weight.out_features, weight.in_features

    def set_quant(self, weight: QuantWeight) -> None:
        self.quant, self.blocks = weight, weight.blocks

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden] fp32
        return quant_linear.dequantize_rows(self.quant, ids).view(*ids.shape, self.embedding_dim)

    @property
    def weight(self) -> torch.Tensor:  # [V, hidden] fp32, made on each access (drafters, TP sharding)
        return quant_linear.dequantize(self.quant)


class GGUFTensors:
    """The quantized tensors of one GGUF file, by the model's names."""

    def __init__(self, path: Path, cfg: ModelConfig | None):
        self.path = path
        self.cfg = cfg
        self._file = GGUFHeader(path)
        arch = self._file.metadata.get("general.architecture")
        self.architecture = arch if isinstance(arch, str) else ""
        self.permuted_qk = self.architecture == "llama"  # as transformers' LlamaTensorProcessor

    def get(self, name: str) -> QuantWeight | None:
        """A GGUF tensor [out, in] as blocks, or None if it is absent, not 2-d, or of a type the
        kernel lacks."""
        t = self._file.tensors.get(name)
        if t is None or t.qtype not in quant_linear.TYPES or len(t.dims) != 2:
            return None
        # copied out of the memory map by torch, so the memory profiler counts it as weights
        data = self._file.data(t)  # [out, in/32 * B], read-only memory map
        blocks = torch.empty(data.shape, dtype=torch.uint8)
        blocks.numpy()[...] = data
        return QuantWeight.from_gguf(blocks, t.qtype, t.dims[0])

    def _fused(self, names: list[str], perms: list[int | None]) -> QuantWeight | None:
        parts = []
        for name, n_head in zip(names, perms):
            w = self.get(name)
            if w is None:
                return None
            permute = n_head is not None and self.permuted_qk
            parts.append(w.rows(reverse_permute_rows(w.out_features, n_head)) if permute else w)
        if len({p.qtype for p in parts}) != 1:
            return None
        return QuantWeight.cat(parts)

    def layer(self, i: int) -> dict[str, QuantWeight | None]:
        """The quantized weights of decoder layer i by Linear attribute (None: load it dense)."""
        p, c = f"blk.{i}.", self.cfg
        return {
            "qkv_proj": self._fused([p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"],
                                    [c.num_heads, c.num_kv_heads, None]),
            "o_proj": self.get(p + "attn_output.weight"),
            "gate_up_proj": self._fused([p + "ffn_gate.weight", p + "ffn_up.weight"], [None, None]),
            "down_proj": self.get(p + "ffn_down.weight"),
        }

    def embedding(self) -> QuantWeight | None:
        return self.get("token_embd.weight")

    def head(self) -> QuantWeight | None:
        return self.get("output.weight")


def token_embedding(path: Path) -> QuantEmbedding | None:
    """A GGUF file's token embedding as its own quantized rows, for a drafter service's EAGLE-3
    head, which only looks rows up in it (SmolLM2's Q8_0: 28 MiB of blocks where the dense fp32
    copy is 108 MiB). None: the file has none, or of a type the kernel lacks (read it dense)."""
    w = GGUFTensors(path, None).embedding()
    return None if w is None else QuantEmbedding(w)


def attach(model, path: Path) -> str:
    """Give the model's linear layers (and embedding, untied head) the file's quantized blocks
    where their type has a kernel; their dense weights are freed before anything is copied into
    them. Returns what was kept, for the log and the memory plan, e.g. 'native Q4_1 x210, Q8_0 x1'."""
    src = GGUFTensors(path, model.cfg)
    kept: dict[str, int] = {}
    layers: dict[str, int] = {}  # linear layers per type (for the log)
    total = 0

    placed: list = []  # (the module holding it, the weight), in the order a step reads them

    def note(owner, w: QuantWeight) -> None:
        nonlocal total
        kept[w.qtype] = kept.get(w.qtype, 0) + 1
        total += w.nbytes
        placed.append((owner, w))

    for i, layer in enumerate(model.layers):
        for attr, w in src.layer(i).items():
            lin = getattr(layer, attr)
            if w is None:
                continue
            if (w.out_features, w.in_features) != (lin.out_features, lin.in_features):
                raise ValueError(f"{path.name} layer {i} {attr}: {w.out_features}x{w.in_features}, "
                                 f"the config expects {lin.out_features}x{lin.in_features}")
            w = quant_linear.for_kernel(w)
            lin.set_quant(w)
            note(lin, w)
            layers[w.qtype] = layers.get(w.qtype, 0) + 1
    emb = src.embedding()
    if emb is not None and (emb.out_features, emb.in_features) == tuple(model.embed_tokens.weight.shape):
        # the tied head multiplies with it every step: the kernel's layout (lookups gather rows from it)
        model.embed_tokens = QuantEmbedding(quant_linear.for_kernel(emb) if model.lm_head is None else emb)
        note(model.embed_tokens, model.embed_tokens.quant)
    head = src.head()
    if head is not None and model.lm_head is not None:
        head = quant_linear.for_kernel(head)
        model.lm_head.set_quant(head)
        note(model.lm_head, head)
    # one huge-page buffer for all the blocks (kv/huge_pages.py); the embedding, read a few
    # rows a step, goes last with the tied head it also is
    placed.sort(key=lambda p: isinstance(p[0], QuantEmbedding))
    moved = huge_pages.into_huge_pages([w.blocks for _, w in placed])
    huge = bool(placed) and moved[0] is not placed[0][1].blocks
    for (owner, w), blocks in zip(placed, moved):
        owner.set_quant(QuantWeight(blocks, w.qtype, w.in_features, w.layout))
    summary = ", ".join(f"{t} x{n}" for t, n in sorted(kept.items()))
    parts = [f"{t} for {n} linear layers" for t, n in sorted(layers.items())]
    if emb is not None and isinstance(model.embed_tokens, QuantEmbedding):
        parts.append(f"{emb.qtype} embedding" + (" (the tied head)" if model.lm_head is None else ""))
    if head is not None and model.lm_head is not None and model.lm_head.quant is not None:
        parts.append(f"{head.qtype} head")
    tiled = sum(w.layout == "tiles" for _, w in placed)  # the AMX loop's layout (kernels/quant_linear.py)
    amx = (f"; AMX tiles for {tiled} of {len(placed)}" if tiled else "") + ("; in huge pages" if huge else "")
    log.info("weights: native %s (%.1f MB of blocks) from %s; the rest dense%s", ", ".join(parts) or "none",
             total / 1e6, path.name, amx)
    return f"native {summary} ({total / 1e6:.1f} MB{amx})" if kept else "fp32"
