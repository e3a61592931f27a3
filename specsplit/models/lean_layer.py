"""A decoder layer's decode or verify step as direct calls into the CPU kernels.

With GGUF blocks on the CPU (kernels/cpu/quant_linear.cpp) and the C++ glue
(kernels/cpu/decode_ops.cpp), every piece of a layer is one compiled call: two norms, four
linears, rope, the KV store, attention, silu * up. Through the modules a layer still cost ~15
Python-level calls more than that (nn.Module.__call__, the rows -> kernel lookup of
cpu_linear.run, the dispatch and usability checks of each op): about 1.5-2 ms of SmolLM2-135M's
13-17 ms one-token step on the AMX Xeon (one thread; this path on and off, interleaved, 6 rounds:
14.4 -> 12.2 ms at context 40, 16.9 -> 15.2 ms at context 300).

`LeanLayer` makes the same calls with the same arguments in the same order, so a step's output is
the module path's bit for bit (tests/unit/models/test_lean_layer.py). Where kernels/layer_stack.py
builds, the model runs the same steps of all its layers in one compiled call instead
(`LlamaForCausalLM.lean_stack`, from these layers' `weights` and norms; the same bits again): the
~30 Python calls of a step cost ~0.6 ms of SmolLM2-135M's ~10 ms on the AMX Xeon. Which layers may run it, and
for which row counts, is LlamaForCausalLM.select_kernels' decision (the kernels it chose): with
weights in AMX tiles every row count, prefill included; in the rows layout up to the count where a
linear's table leaves the quantized kernel (16 by the static table). A batch past that, or with a
draft tree of more than KERNEL_TREE_NODES nodes (models/attention.py), runs the modules.
"""
from __future__ import annotations

from typing import Callable

import torch

from specsplit.kernels import decode_ops, quant_linear


class LeanLayer:
    """One DecoderLayer's step [T, hidden] -> [T, hidden], T <= `rows`, fp32 on the CPU."""

    def __init__(self, layer, rows: int):
        ops = decode_ops.load()
        self.rows = rows  # the most rows every linear of the layer runs on the quantized kernel
        self.rms_norm: Callable = ops.rms_norm
        self.rope: Callable = ops.rope
        self.store_kv: Callable = ops.store_kv
        self.attention: Callable = ops.paged_attention
        self.silu_mul: Callable = ops.silu_mul
        # (QuantWeight, bias) of qkv, o, gate_up, down: what the calls below bind, and what
        # kernels/layer_stack.py's one-call step of all the layers holds
        self.weights = [(m.quant, m.bias) for m in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)]
        self.qkv, self.o, self.gate_up, self.down = (quant_linear.bind(w, b) for w, b in self.weights)
        self.input_norm = (layer.input_norm.weight, layer.input_norm.eps)
        self.post_attn_norm = (layer.post_attn_norm.weight, layer.post_attn_norm.eps)
        self.head_dim = layer.head_dim
        self.num_kv_heads = layer.num_kv_heads
        self.q_size = layer.q_size
        self.qk_size = layer.q_size + layer.kv_size  # q and k columns of the qkv output
        self.qk_heads = layer.num_heads + layer.num_kv_heads
        self.num_heads = layer.num_heads
        self.scale = layer.scale
        self.avx512 = quant_linear.avx512_allowed()  # the attention's loop, as the stack's layers pass it

    def __call__(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, 1, D] (RotaryEmbedding.tables)
        sin: torch.Tensor,  # [T, 1, D] signed
        meta,  # BatchMetadata with block_tables, q_lens_t, kv_lens_t (and tree_mask where it has a tree)
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,
    ) -> torch.Tensor:  # [T, hidden]
        t = x.shape[0]
        qkv = self.qkv(self.rms_norm(x, *self.input_norm))  # [T, q + 2kv]
        qk = self.rope(qkv[:, :self.qk_size].view(t, self.qk_heads, self.head_dim), cos, sin)  # [T, H + Hkv, D]
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]  # slices: Tensor.split's Python wrapper cost ~14 us
        v = qkv[:, self.qk_size:].view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        self.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        attn = self.attention(q.contiguous(), k_cache, v_cache, meta.block_tables, meta.q_lens_t, meta.kv_lens_t,
                              self.scale, self.avx512, meta.tree_mask)  # [T, H, D]
        x = x + self.o(attn.reshape(t, self.q_size))
        gate_up = self.gate_up(self.rms_norm(x, *self.post_attn_norm))  # [T, 2I]
        return x + self.down(self.silu_mul(gate_up))
