"""Tensor parallelism for the native Llama-family model: shard a loaded LlamaForCausalLM in place.

Megatron-style, over a torch.distributed group of N ranks (gloo on the CPU, NCCL on CUDA):

    attention   qkv_proj  column-parallel by KV head: the KV heads are split as evenly as the
                          count allows and each rank keeps the query heads reading them; when
                          Hkv < N, N/Hkv ranks share a KV head (each keeps a copy) and split
                          its query heads
                o_proj    row-parallel: the columns of its own heads, then all_reduce (sum)
    MLP         gate_up   column-parallel: ~I/N rows of gate and the same rows of up
                down      row-parallel: the matching columns, then all_reduce
    head        vocab-parallel: ceil(V/N) rows per rank (zero-padded), logits all_gathered, so
                every rank returns the full [N, V] row and sampling runs unchanged on rank 0
    embedding, norms, rope: replicated (small next to the layers; a lookup needs no collective)

Each rank's paged KV cache then holds only its KV heads: `shard_model` returns the rank's model
config (num_heads / num_kv_heads per rank), which is what the cache and the memory plan are
sized from. The per-rank forward is the unchanged DecoderLayer.forward: the layer's head counts
are set to the rank's, and o_proj / down_proj become RowParallelLinear (a Linear that adds the
all_reduce). The CPU kernels (models/cpu_linear.py) are chosen for the shard's own shapes.

Numerics: a row-parallel layer sums N partial dot products in another order than one rank
would, so TP=N logits equal TP=1 logits within fp32 rounding, not bit for bit (the tests check
that, and greedy equality through tests/helpers/greedy.py).
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import replace

import torch
import torch.distributed as dist

from specsplit.config import ModelConfig
from specsplit.models import cpu_linear
from specsplit.models.llama import DecoderLayer, Linear, LlamaForCausalLM


def _chunk(n: int, rank: int, world: int) -> range:
    """Rank `rank`'s contiguous part of n items split as evenly as possible (sizes differ by <= 1)."""
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


def check_shardable(cfg: ModelConfig, world: int) -> None:
    """Refuse (ValueError, with the numbers) a model that does not split over `world` ranks."""
    if world < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1, got {world}")
    problems = []
    if cfg.num_kv_heads < world and (world % cfg.num_kv_heads or cfg.num_heads % world):
        problems.append(f"{cfg.num_kv_heads} KV heads are fewer than {world} ranks, so each must be shared by "
                        f"whole ranks: {world} must be a multiple of {cfg.num_kv_heads} and {cfg.num_heads} query "
                        f"heads must divide by {world}")
    if cfg.intermediate_size < world:
        problems.append(f"MLP width {cfg.intermediate_size} is below {world}")
    if problems:
        raise ValueError(f"cannot split the model over --tensor-parallel-size {world}: " + "; ".join(problems))


def local_heads(cfg: ModelConfig, rank: int, world: int) -> tuple[range, range]:
    """(query heads, KV heads) rank `rank` keeps, as ranges of global head indices.

    With at least N KV heads, the KV heads are split as evenly as possible and each rank keeps the
    query heads that read them (SmolLM2's 3 KV heads over 2 ranks: 2 and 1, with 6 and 3 query
    heads). With fewer, N/Hkv ranks share each KV head (a copy each) and split its query heads."""
    group = cfg.num_heads // cfg.num_kv_heads  # query heads per KV head
    if cfg.num_kv_heads >= world:
        kv = _chunk(cfg.num_kv_heads, rank, world)
        return range(kv.start * group, kv.stop * group), kv
    hq = cfg.num_heads // world
    kv_head = rank // (world // cfg.num_kv_heads)
    return range(rank * hq, (rank + 1) * hq), range(kv_head, kv_head + 1)


def local_mlp(cfg: ModelConfig, rank: int, world: int) -> range:
    return _chunk(cfg.intermediate_size, rank, world)


def local_config(cfg: ModelConfig, rank: int, world: int) -> ModelConfig:
    """The config rank `rank`'s layers and KV cache are built for (vocab and hidden size stay global)."""
    q, kv = local_heads(cfg, rank, world)
    return replace(cfg, num_heads=len(q), num_kv_heads=len(kv), intermediate_size=len(local_mlp(cfg, rank, world)))


def _rows(w: torch.Tensor, heads: range, head_dim: int, offset: int = 0) -> torch.Tensor:
    return w[offset + heads.start * head_dim: offset + heads.stop * head_dim]


def _new_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    lin = Linear(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=weight.dtype, device=weight.device)
    with torch.no_grad():
        lin.weight.copy_(weight)
        if bias is not None:
            lin.bias.copy_(bias)
    lin.requires_grad_(False)
    return lin


class RowParallelLinear(Linear):
    """A row-parallel Linear: this rank's partial product, summed over the group (all_reduce).
    A Linear itself, so the CPU kernel choice (LlamaForCausalLM.select_kernels) treats it as any."""

    group = None

    @classmethod
    def of(cls, inner: Linear, group) -> "RowParallelLinear":
        inner.__class__ = cls
        inner.group = group
        return inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in/N] -> [T, out]
        out = super().forward(x)
        dist.all_reduce(out, group=self.group)
        return out


def _shard_layer(layer: DecoderLayer, cfg: ModelConfig, rank: int, world: int, group) -> None:
    d = cfg.head_dim
    q_heads, kv_heads = local_heads(cfg, rank, world)
    q_size, kv_size = cfg.num_heads * d, cfg.num_kv_heads * d

    def qkv(t: torch.Tensor) -> torch.Tensor:  # rows [q | k | v] of a weight or a bias
        return torch.cat([_rows(t, q_heads, d), _rows(t, kv_heads, d, q_size), _rows(t, kv_heads, d, q_size + kv_size)])

    w = layer.qkv_proj.dense_weight()
    b = layer.qkv_proj.bias
    layer.qkv_proj = _new_linear(qkv(w), None if b is None else qkv(b))
    w = layer.o_proj.dense_weight()  # [hidden, H*D]
    layer.o_proj = RowParallelLinear.of(_new_linear(w[:, q_heads.start * d: q_heads.stop * d].contiguous(), None), group)
    mlp = local_mlp(cfg, rank, world)
    w = layer.gate_up_proj.dense_weight()  # [2I, hidden]: gate rows then up rows
    lo, hi = mlp.start, mlp.stop
    I = cfg.intermediate_size
    layer.gate_up_proj = _new_linear(torch.cat([w[lo:hi], w[I + lo: I + hi]]), None)
    w = layer.down_proj.dense_weight()  # [hidden, I]
    layer.down_proj = RowParallelLinear.of(_new_linear(w[:, lo:hi].contiguous(), None), group)
    layer.num_heads, layer.num_kv_heads = len(q_heads), len(kv_heads)
    layer.q_size, layer.kv_size = len(q_heads) * d, len(kv_heads) * d


class TPLlamaForCausalLM(LlamaForCausalLM):
    """A LlamaForCausalLM whose layers hold one rank's shard (the class of a sharded model).

    The head is this rank's rows of the vocabulary, held where a draft keeps its vocabulary-subset
    head (`_subset_head`, so the CPU kernel choice covers it), with `vocab_subset` unset: the
    local logits [N, ceil(V/N)] are all_gathered into the full row.

    `driver` (rank 0 while serving) is told every forward's inputs first, so that the workers run
    the same forward on their shards (see specsplit.parallel.group)."""

    tp_rank: int
    tp_size: int
    tp_group: object
    driver = None  # object with .forward_started(input_ids, meta), or None

    def _logits(self, x: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, V] float32
        local = super()._logits(x).contiguous()  # [N, ceil(V/N)]: this rank's rows of the head
        parts = [torch.empty_like(local) for _ in range(self.tp_size)]
        dist.all_gather(parts, local, group=self.tp_group)
        return torch.cat(parts, dim=-1)[:, : self.cfg.vocab_size]

    def head_weight(self) -> torch.Tensor:
        raise RuntimeError("a tensor-parallel model has no whole head on one rank")

    def set_vocab_subset(self, token_ids) -> None:
        if token_ids is not None:
            raise RuntimeError("a vocabulary subset (a draft's head) is not supported with tensor parallelism")

    def _greedy_head(self, x: torch.Tensor) -> None:
        return None  # every rank must run _logits (its all_gather) in each forward

    @torch.inference_mode()
    def forward(self, input_ids, meta, kv, capture=None, greedy: bool = False):
        if capture is not None:
            raise RuntimeError("a feature drafter (EAGLE-3) is not supported with tensor parallelism yet: "
                               "use a model or n-gram draft, or --tensor-parallel-size 1")
        if self.driver is not None:
            self.driver.forward_started(input_ids, meta)
        return super().forward(input_ids, meta, kv, greedy=greedy)


def shard_model(model: LlamaForCausalLM, rank: int, world: int, group=None, kernel_policy: str | None = None) -> ModelConfig:
    """Keep rank `rank`'s shard of every layer and of the head, in place; returns the rank's config
    (what its KV cache is sized from). The model should come dense (loaded with the kernel policy
    'dense', see unpacked_load); the CPU kernels are chosen again for the shard's shapes."""
    cfg = model.cfg
    check_shardable(cfg, world)
    model.forget_kernels()  # kernels chosen for the whole model: start over from dense weights
    for layer in model.layers:
        _shard_layer(layer, cfg, rank, world, group)
    head = model.head_weight()  # [V, hidden]: the tied embedding or the untied head
    per = -(-cfg.vocab_size // world)
    rows = head[rank * per: min(cfg.vocab_size, (rank + 1) * per)]
    if rows.shape[0] < per:
        rows = torch.cat([rows, rows.new_zeros(per - rows.shape[0], rows.shape[1])])
    model.keep_head_rows(rows)  # an untied head's full weight is freed; a tied one stays the embedding
    model.untracked_weight_bytes = 0
    model.__class__ = TPLlamaForCausalLM
    model.tp_rank, model.tp_size, model.tp_group = rank, world, group
    local = local_config(cfg, rank, world)
    model.cfg = local  # the KV cache (ModelRunner) reads num_kv_heads and head_dim from here
    model.select_kernels(kernel_policy)
    return local


@contextlib.contextmanager
def unpacked_load():
    """Load with the dense kernel policy (no packing, no timing): the weights are sharded first and
    the kernels chosen for the shard's shapes after (shard_model). Yields the policy to use then."""
    old = os.environ.get(cpu_linear.ENV_POLICY)
    policy = cpu_linear.policy()
    os.environ[cpu_linear.ENV_POLICY] = cpu_linear.DENSE
    try:
        yield policy
    finally:
        if old is None:
            os.environ.pop(cpu_linear.ENV_POLICY, None)
        else:
            os.environ[cpu_linear.ENV_POLICY] = old
