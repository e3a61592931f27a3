"""Batch description for one forward, and attention over the paged KV cache.

A batch is a flat run of T new tokens from B sequences, no padding in the token dimension.
Sequence b contributes q_lens[b] new tokens at positions kv_lens[b]-q_lens[b] .. kv_lens[b]-1;
each new token attends to the sequence's cached prefix and causally to the new tokens before it.
That one rule covers prefill chunks (q = chunk), decode (q = 1) and verification (q = k+1).

Tree verification (specsplit.draft_tree) changes it for a sequence's last n new tokens, the nodes
of a draft tree with parents `trees[b]`: node i sits in KV slot kv-n+i but at rope position
(kv-n-1) + depth(i), and attends to the slots before the tree and to its own ancestors only.
The C++ kernel takes each node's ancestors as bits (`tree_mask`, trees of up to
KERNEL_TREE_NODES nodes); larger trees run the torch attention with the mask.

Attention groups sequences with the same q_len and runs one padded SDPA per group: decode and
verification batches are one group, so a layer costs one gather and one SDPA call.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from specsplit.kernels import decode_ops, dispatch, quant_linear
from specsplit.draft_tree import ancestor_bits, ancestor_mask, tree_depths

KERNEL_TREE_NODES = 63  # the most nodes of a tree the C++ attention takes (bits of an int64; its TREE_MAX_NODES)


@dataclass
class AttentionGroup:
    seq_index: torch.Tensor  # [G] which sequences of the batch (indices into q_lens)
    token_index: torch.Tensor  # [G * q] flat token indices of those sequences' new tokens
    q_len: int
    block_tables: torch.Tensor  # [G, max_blocks] int64
    mask: torch.Tensor | None  # [G, 1, q, max_blocks*block_size] bool, True = attend; None = all
    covers_all: bool = False  # token_index is 0..T-1 in order (the only group): no gather/scatter


@dataclass
class BatchMetadata:
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64 flat cache slot each new token's K/V is written to
    q_lens: list[int]  # [B]
    kv_lens: list[int]  # [B] context length after this forward
    logits_index: torch.Tensor  # [N] flat token indices whose logits are wanted
    all_slots_valid: bool = False  # no slot < 0 in slot_mapping: KV writes need no masking
    # every sequence in batch order, for kernels that take the whole batch (kernels/decode_ops):
    block_tables: torch.Tensor | None = None  # [B, max_blocks] int64
    q_lens_t: torch.Tensor | None = None  # [B] int64
    kv_lens_t: torch.Tensor | None = None  # [B] int64
    has_tree: bool = False  # some sequence's new tokens end in a draft tree
    # [T] int64, where has_tree and every tree has at most KERNEL_TREE_NODES nodes: a tree node's
    # row holds its ancestor bits (draft_tree.ancestor_bits), every other row 0; the C++ attention
    # reads it. None: no tree, or the torch attention with the groups' masks
    tree_mask: torch.Tensor | None = None
    # the torch attention's groups, made when first asked for (`groups`): a step through the CPU
    # kernels (models/lean_layer.py, kernels/layer_stack.py) never asks, and making them (masks,
    # gathers) was ~0.2 ms of SmolLM2-135M's ~10 ms one-token step on the AMX Xeon
    _group_inputs: tuple | None = field(default=None, repr=False)
    _groups: list[AttentionGroup] | None = field(default=None, repr=False)

    @property
    def kernel_attends(self) -> bool:
        """Whether the C++ attention takes this batch: no tree, or every tree's bits in tree_mask."""
        return not self.has_tree or self.tree_mask is not None

    @property
    def groups(self) -> list[AttentionGroup]:
        if self._groups is None:
            self._groups = _attention_groups(*self._group_inputs)
        return self._groups

    @classmethod
    def build(
        cls,
        q_lens: list[int],
        kv_lens: list[int],
        block_tables: list[list[int]],
        slot_mapping: list[int],
        logits_per_seq: list[int],
        block_size: int,
        device: torch.device,
        trees: list[tuple[int, ...] | None] | None = None,
    ) -> "BatchMetadata":
        """trees[b]: the parents of sequence b's last len(trees[b]) new tokens (a draft tree,
        specsplit.draft_tree); None (or no list): its new tokens are a plain causal run."""
        trees = trees or [None] * len(q_lens)
        positions: list[int] = []
        starts: list[int] = []
        logits_index: list[int] = []
        has_tree = any(bool(t) for t in trees)
        tree_bits: list[int] | None = [] if has_tree and all(len(t or ()) <= KERNEL_TREE_NODES for t in trees) else None
        offset = 0
        for q, kv, n_logits, tree in zip(q_lens, kv_lens, logits_per_seq, trees):
            starts.append(offset)
            if tree:
                root = kv - len(tree) - 1  # the root's position: the last token before the nodes
                positions.extend(range(kv - q, root + 1))
                positions.extend(root + d for d in tree_depths(tree))
            else:
                positions.extend(range(kv - q, kv))
            if tree_bits is not None:
                tree_bits.extend([0] * (q - len(tree or ())))
                tree_bits.extend(ancestor_bits(tree or ()))
            logits_index.extend(range(offset + q - n_logits, offset + q))
            offset += q

        # every sequence's block table, zero-padded to the longest: [B, max_blocks]
        all_tables = torch.zeros((len(q_lens), max((len(t) for t in block_tables), default=0)), dtype=torch.int64)
        for b, table in enumerate(block_tables):
            all_tables[b, : len(table)] = torch.tensor(table, dtype=torch.int64)
        return cls(
            block_tables=all_tables.to(device),
            q_lens_t=torch.tensor(q_lens, dtype=torch.int64, device=device),
            kv_lens_t=torch.tensor(kv_lens, dtype=torch.int64, device=device),
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
            q_lens=list(q_lens),
            kv_lens=list(kv_lens),
            logits_index=torch.tensor(logits_index, dtype=torch.int64, device=device),
            all_slots_valid=all(s >= 0 for s in slot_mapping),
            has_tree=has_tree,
            tree_mask=None if tree_bits is None else torch.tensor(tree_bits, dtype=torch.int64, device=device),
            _group_inputs=(list(q_lens), list(kv_lens), block_tables, all_tables, starts, trees, block_size, device),
        )


def _attention_groups(q_lens: list[int], kv_lens: list[int], block_tables: list[list[int]], all_tables: torch.Tensor,
                      starts: list[int], trees: list, block_size: int, device: torch.device) -> list[AttentionGroup]:
    """The batch's sequences grouped by new-token count, each group with its tables and mask
    (BatchMetadata.groups, for the torch attention)."""
    by_q: dict[int, list[int]] = {}
    for b, q in enumerate(q_lens):
        by_q.setdefault(q, []).append(b)
    groups = []
    single = len(by_q) == 1
    for q, members in by_q.items():
        max_blocks = max(len(block_tables[b]) for b in members)
        tables = all_tables[members, :max_blocks]  # [G, max_blocks], the group's rows
        token_index = torch.tensor([starts[b] + j for b in members for j in range(q)], dtype=torch.int64)
        kv = torch.tensor([kv_lens[b] for b in members], dtype=torch.int64)  # [G]
        span = max_blocks * block_size
        key_pos = torch.arange(span)  # [S]
        query_pos = kv[:, None] - q + torch.arange(q)[None, :]  # [G, q] absolute positions
        mask = key_pos[None, None, :] <= query_pos[:, :, None]  # [G, q, S] causal and in-range
        for row, b in enumerate(members):
            if trees[b]:
                n, end = len(trees[b]), kv_lens[b]
                mask[row, q - n:, end - n:end] = ancestor_mask(trees[b])  # [n, n] nodes see their ancestors
        full = bool(mask.all())
        groups.append(
            AttentionGroup(
                seq_index=torch.tensor(members, dtype=torch.int64, device=device),
                token_index=token_index.to(device),
                q_len=q,
                block_tables=tables.to(device),
                mask=None if full else mask[:, None].to(device),
                covers_all=single,  # one group holds every sequence, in batch order
            )
        )
    return groups


def store_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    meta: BatchMetadata,
) -> None:
    # One place decides torch vs Triton (specsplit.kernels.dispatch): Triton on CUDA, torch on CPU.
    dispatch.store_kv(key, value, k_cache, v_cache, meta.slot_mapping, all_valid=meta.all_slots_valid)


def paged_attention(
    query: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    meta: BatchMetadata,
    scale: float,
) -> torch.Tensor:  # [T, H, D]
    if (meta.block_tables is not None and meta.kernel_attends and decode_ops.usable(query) and k_cache.dtype == torch.float32
            and query.shape[2] % 8 == 0):
        # fp32 on the CPU: the whole batch in one call, reading the blocks in place
        return decode_ops.load().paged_attention(query.contiguous(), k_cache, v_cache, meta.block_tables,
                                                 meta.q_lens_t, meta.kv_lens_t, scale, quant_linear.avx512_allowed(),
                                                 meta.tree_mask)
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    out = None if meta.groups[0].covers_all else torch.empty_like(query)
    for g in meta.groups:
        n = g.block_tables.shape[0]
        # Gather each sequence's blocks into a contiguous context: [G, S, Hkv, D].
        flat_tables = g.block_tables.reshape(-1)  # index_select: cheaper than advanced indexing on CPU
        keys = k_cache.index_select(0, flat_tables).reshape(n, -1, num_kv_heads, head_dim)
        values = v_cache.index_select(0, flat_tables).reshape(n, -1, num_kv_heads, head_dim)
        q = query if g.covers_all else query[g.token_index]
        q = q.reshape(n, g.q_len, num_heads, head_dim).transpose(1, 2)  # [G, H, q, D]
        o = F.scaled_dot_product_attention(
            q,
            keys.transpose(1, 2),  # [G, Hkv, S, D]
            values.transpose(1, 2),
            attn_mask=g.mask,
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )  # [G, H, q, D]
        o = o.transpose(1, 2).reshape(n * g.q_len, num_heads, head_dim)
        if g.covers_all:
            return o
        out[g.token_index] = o
    return out
