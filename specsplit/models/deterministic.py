"""--deterministic: batch-invariant numerics, so a sequence's logits do not depend on the batch it
runs in, on how many tokens it brings to a step (1 decoding, K+1 verifying, a prefill chunk) or
on where in the batch it sits. Then speculative greedy equals target-only greedy bit for bit.

Why it is needed: a matmul kernel blocks its reduction by the number of rows M (MKL's fp32 gemv
for M=1 and its small-M GEMM for M=2..16 sum in different orders; oneDNN likewise), and attention
over a padded group of sequences reduces over the group's longest context. A row's result then
moves by rounding with the company it keeps, and greedy can flip at a near-tie.

What changes (opt-in; applied to a loaded model, in place):
* every linear layer and the head run one row per call (M = 1 always), each row copied to a fresh,
  aligned buffer: the same kernel and the same summation order for every token of every batch.
* attention runs per token over exactly that token's causal context (positions 0..p): scores as
  an elementwise product summed over head_dim, softmax over the context, the weighted sum of
  values over the context; the reduction lengths depend only on the position p, never on the
  batch, the group padding or the number of new tokens. In fp32 whatever the model's dtype.
* RMSNorm, RoPE, SiLU, residual adds and the embedding are per-row or elementwise already.
* tensor parallel: the all_reduce of two ranks adds two numbers (a + b == b + a exactly), so at
  TP=2 the result does not depend on the batch either; with more ranks the order of a ring
  all_reduce depends on the buffer length, and this mode does not claim invariance there.

Cost: a step reads the weights once per token instead of once per step, so verifying K+1 tokens
or decoding a batch of B costs about (K+1) or B decode steps of weight traffic, and prefill is
far slower; attention is a Python loop over tokens. It is meant for checking and for workloads
that need bit-for-bit reproducibility, not for speed (the README gives measured numbers).
"""
from __future__ import annotations

import torch

from specsplit.models.attention import BatchMetadata
from specsplit.models.llama import DecoderLayer, Linear, LlamaForCausalLM


def _rows(fn, x: torch.Tensor) -> torch.Tensor:
    """fn over each row of x [M, in] on its own ([1, in] -> [1, out]), concatenated."""
    if x.shape[0] == 1:
        return fn(x.clone())
    return torch.cat([fn(x[i: i + 1].clone()) for i in range(x.shape[0])])


class RowwiseLinear(Linear):
    """A Linear that multiplies one row per call. Placed before the class it is mixed into (see
    make_deterministic), so a RowParallelLinear still all_reduces the whole [M, out] once."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _rows(super().forward, x)


class _RowwiseHead:
    def __init__(self, head):
        self.head = head

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _rows(self.head, x)


def batch_invariant_attention(
    query: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    meta: BatchMetadata,
    scale: float,
) -> torch.Tensor:  # [T, H, D]
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    rep = num_heads // num_kv_heads
    tables: dict[int, torch.Tensor] = {}
    masks: dict[int, torch.Tensor] = {}  # draft trees: [q, S] which keys each new token sees
    for g in meta.groups:
        for i, b in enumerate(g.seq_index.tolist()):
            tables[b] = g.block_tables[i]
            if meta.has_tree and g.mask is not None:
                masks[b] = g.mask[i, 0]
    out = torch.empty_like(query)
    start = 0
    for b, (q_len, kv_len) in enumerate(zip(meta.q_lens, meta.kv_lens)):
        blocks = tables[b][: -(-kv_len // block_size)]
        keys = k_cache.index_select(0, blocks).reshape(-1, num_kv_heads, head_dim)[:kv_len].float()
        values = v_cache.index_select(0, blocks).reshape(-1, num_kv_heads, head_dim)[:kv_len].float()
        if rep > 1:
            keys = keys.repeat_interleave(rep, dim=1)  # [kv_len, H, D]
            values = values.repeat_interleave(rep, dim=1)
        for j in range(q_len):
            t = start + j
            ctx = kv_len - q_len + j + 1  # this token's causal context: positions 0 .. its own
            k_j, v_j = keys[:ctx], values[:ctx]
            if b in masks:  # a tree node: the context before the tree and its ancestors
                seen = masks[b][j, :kv_len].nonzero().flatten()
                k_j, v_j = keys[seen], values[seen]
            scores = (k_j * query[t].float()).sum(-1) * scale  # [ctx, H], each a sum over D
            probs = torch.softmax(scores, dim=0)  # over the context only
            out[t] = (probs[:, :, None] * v_j).sum(0).to(query.dtype)  # [H, D]
        start += q_len
    return out


def make_deterministic(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """Switch a loaded model (plain or tensor-parallel shard) to batch-invariant numerics, in place."""
    if getattr(model, "deterministic", False):
        return model
    for m in model.modules():
        if isinstance(m, Linear) and not isinstance(m, RowwiseLinear):
            cls = type(m)
            m.__class__ = RowwiseLinear if cls is Linear else type(f"Rowwise{cls.__name__}", (cls, RowwiseLinear), {})
    for layer in model.modules():
        if isinstance(layer, DecoderLayer):
            layer.attention = batch_invariant_attention
    model.lean_layers = model.lean_stack = None  # the lean step calls the plain kernels (models/lean_layer.py)
    model.wrap_head(_RowwiseHead)
    model.deterministic = True
    return model

