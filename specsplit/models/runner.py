"""ModelRunner: one model, its paged KV cache and block manager; sequences of tokens in, logits out.

The runner knows nothing of sampling or speculation. `forward` appends new tokens of several
sequences to their KV in one batched pass and returns the logits the caller asked for;
`truncate` rolls a sequence back (rejected drafts); `free` releases it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specsplit.kv.block_manager import BlockManager
from specsplit.kv.paged_cache import PagedKVCache
from specsplit.models.attention import BatchMetadata
from specsplit.models.llama import LlamaForCausalLM


@dataclass(frozen=True)
class ForwardItem:
    seq_id: str
    start: int  # tokens of this sequence already in the KV cache
    token_ids: tuple[int, ...] | list[int]  # new tokens at positions start .. start+len-1
    num_logits: int = 1  # logits wanted for the last num_logits new tokens
    # The last len(tree) new tokens are a draft tree with these parents (specsplit.draft_tree);
    # None: a plain causal run. Their logits must all be wanted (num_logits > len(tree)).
    tree: tuple[int, ...] | None = None


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int, max_model_len: int):
        cfg = model.cfg
        self.model = model
        self.device = model.device
        self.max_model_len = max_model_len
        self.block_manager = BlockManager(num_blocks, block_size)
        self.kv = PagedKVCache(
            cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, model.dtype, model.device
        )

    @property
    def vocab_size(self) -> int:
        return self.model.cfg.vocab_size

    def forward(self, items: list[ForwardItem], features: tuple[int, ...] = (),
                out_features: list | None = None, greedy: bool = False) -> list[torch.Tensor]:
        """Run one forward; returns per item logits [num_logits, V] float32 (greedy: the greedy
        ids [num_logits] int64 instead, LlamaForCausalLM.forward's `greedy`).

        features: target layers to capture; out_features (a list) then receives, per item, the
        fused outputs of those layers [len(token_ids), len(features) * hidden] (feature drafters).

        Each item's KV is first cut to `start` tokens and grown to start+len(token_ids) slots, so a
        caller can re-feed positions after a rollback without a separate truncate.
        """
        bm = self.block_manager
        self.check_items(items)
        # Grow all first: an OutOfBlocks leaves earlier items grown, which truncate undoes.
        grown: list[tuple[str, int]] = []
        try:
            for it in items:
                if not bm.has(it.seq_id):
                    bm.allocate(it.seq_id, 0)
                grown.append((it.seq_id, bm.length(it.seq_id)))
                bm.truncate(it.seq_id, it.start)
                bm.grow_to(it.seq_id, it.start + len(it.token_ids))
        except Exception:
            for seq_id, length in grown:
                bm.truncate(seq_id, min(length, bm.length(seq_id)))
            raise
        q_lens = [len(it.token_ids) for it in items]
        kv_lens = [it.start + q for it, q in zip(items, q_lens)]
        slots: list[int] = []
        for it, kv in zip(items, kv_lens):
            slots.extend(bm.slots(it.seq_id, it.start, kv))
        meta = BatchMetadata.build(
            q_lens=q_lens,
            kv_lens=kv_lens,
            block_tables=[bm.block_table(it.seq_id) for it in items],
            slot_mapping=slots,
            logits_per_seq=[it.num_logits for it in items],
            block_size=bm.block_size,
            device=self.device,
            trees=[it.tree for it in items] if any(it.tree for it in items) else None,
        )
        input_ids = torch.tensor([t for it in items for t in it.token_ids], dtype=torch.int64, device=self.device)
        capture = dict.fromkeys(features) if features else None
        logits = self.model(input_ids, meta, self.kv, capture=capture, greedy=greedy) if capture or greedy \
            else self.model(input_ids, meta, self.kv)
        if capture:
            fused = torch.cat([capture[i] for i in features], dim=-1)  # [T, F]
            out_features.extend(fused.split(q_lens))
        return list(logits.split([it.num_logits for it in items]))  # [sum num_logits(, V)] per item

    def check_items(self, items: list[ForwardItem]) -> None:
        """Refuse (ValueError) an item with no tokens or one that would pass max_model_len."""
        for it in items:
            if not it.token_ids:
                raise ValueError(f"forward item for {it.seq_id!r} has no tokens")
            end = it.start + len(it.token_ids)
            if end > self.max_model_len:
                raise ValueError(f"sequence {it.seq_id!r} would reach {end} tokens, max_model_len is {self.max_model_len}")

    def move_kv(self, seq_id: str, src: list[int], dst: list[int]) -> None:
        """Copy the K/V at token positions `src` of a sequence to positions `dst` (every layer):
        a verified tree's accepted path into the slots a chain would have used."""
        if not src or src == dst:
            return
        slots = self.block_manager.slots(seq_id, 0, max(max(src), max(dst)) + 1)
        s = torch.tensor([slots[i] for i in src], dtype=torch.int64, device=self.device)
        d = torch.tensor([slots[i] for i in dst], dtype=torch.int64, device=self.device)
        flat = self.kv.data.view(*self.kv.data.shape[:2], -1, *self.kv.data.shape[4:])  # [L, 2, slots, Hkv, D]
        flat[:, :, d] = flat[:, :, s]  # the right side is gathered first: overlapping moves are safe

    def truncate(self, seq_id: str, num_tokens: int) -> None:
        if self.block_manager.has(seq_id):
            self.block_manager.truncate(seq_id, num_tokens)

    def free(self, seq_id: str) -> None:
        self.block_manager.free(seq_id)
