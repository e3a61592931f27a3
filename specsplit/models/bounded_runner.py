"""BoundedRunner: a ModelRunner whose forwards never exceed the shape the memory profiler measured.

The engines may hand the runner any number of sequences with any number of new tokens (a burst
of new prompts is one forward of every prompt's first chunk). The profiler sizes the KV cache
from the activation peak of the largest forward, so that forward must have a bound:

    at most `max_num_seqs` sequences, of which those with more than `window` new tokens (prompt
    chunks, catch-up after speculation was off) hold at most `max_prefill_tokens` tokens together.

`window` is k+1 (a verification or a draft-model catch-up). A call over the bound is run as
several forwards, in order, over the same KV; a sequence whose tokens do not fit is split across
them, which is what chunked prefill does anyway. Results are the same per sequence.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from specsplit.kv.block_manager import BlockManager
from specsplit.models.llama import LlamaForCausalLM
from specsplit.models.runner import ForwardItem, ModelRunner


@dataclass(frozen=True)
class ForwardBound:
    max_num_seqs: int
    window: int  # new tokens of a decode / verify / draft step (k+1)
    max_prefill_tokens: int  # tokens of longer inputs in one forward, all sequences together

    def __post_init__(self):
        if self.max_num_seqs <= 0 or self.window <= 0 or self.max_prefill_tokens <= 0:
            raise ValueError(f"forward bound must be positive, got {self}")

    @property
    def max_tokens(self) -> int:
        return self.max_prefill_tokens + self.max_num_seqs * self.window


@dataclass(frozen=True)
class _Piece:
    index: int  # which input item
    item: ForwardItem
    final: bool  # holds the item's last tokens (and so its logits)


def split_forward(items: list[ForwardItem], bound: ForwardBound) -> list[list[_Piece]]:
    """Cut a forward into groups that each respect the bound; order is kept within each item."""
    groups: list[list[_Piece]] = [[]]
    prefill_left = bound.max_prefill_tokens

    def new_group() -> None:
        nonlocal prefill_left
        groups.append([])
        prefill_left = bound.max_prefill_tokens

    for index, it in enumerate(items):
        start, tokens = it.start, list(it.token_ids)
        while True:
            if len(groups[-1]) >= bound.max_num_seqs:
                new_group()
            n = len(tokens)
            if n <= bound.window:
                groups[-1].append(_Piece(index, replace(it, start=start, token_ids=tokens), True))
                break
            take = min(n, prefill_left)
            if take < n:
                take = min(take, n - it.num_logits)  # the last piece keeps every wanted logit
            if take <= 0:
                if groups[-1]:
                    new_group()
                    continue
                take = n  # more logits wanted than the bound holds: one forward, as before
            final = take == n
            piece = (replace(it, start=start, token_ids=tokens) if final  # a tree stays in its item's last piece
                     else ForwardItem(it.seq_id, start, tokens[:take], 1))
            groups[-1].append(_Piece(index, piece, final))
            prefill_left -= take
            if prefill_left < 0:  # a piece past the bound (all its logits wanted) runs alone
                new_group()
            if final:
                break
            start, tokens = start + take, tokens[take:]
            new_group()
    return [g for g in groups if g]


class BoundedRunner(ModelRunner):
    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int, max_model_len: int, bound: ForwardBound):
        super().__init__(model, num_blocks, block_size, max_model_len)
        self.bound = bound

    def forward(self, items: list[ForwardItem], features: tuple[int, ...] = (),
                out_features: list | None = None, greedy: bool = False) -> list[torch.Tensor]:
        groups = split_forward(list(items), self.bound)
        if len(groups) <= 1:
            return self._forward_group(list(items), features, out_features, greedy)
        self._reserve(items)  # all or nothing, as one forward would be
        out: dict[int, torch.Tensor] = {}
        pieces: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(items))}  # per item, in order
        for group in groups:
            feats: list = []
            logits = self._forward_group([p.item for p in group], features, feats, greedy)
            for j, (p, lg) in enumerate(zip(group, logits)):
                if features:
                    pieces[p.index].append(feats[j])
                if p.final:
                    out[p.index] = lg
        if features:
            out_features.extend(torch.cat(pieces[i]) for i in range(len(items)))
        return [out[i] for i in range(len(items))]

    def _forward_group(self, items: list[ForwardItem], features: tuple[int, ...] = (),
                       out_features: list | None = None, greedy: bool = False) -> list[torch.Tensor]:
        return ModelRunner.forward(self, items, features, out_features, greedy)

    def _reserve(self, items) -> None:
        """Grow every item's KV to its end up front, so OutOfBlocks is raised before any forward."""
        bm: BlockManager = self.block_manager
        self.check_items(items)
        grown: list[tuple[str, int, bool]] = []
        try:
            for it in items:
                new = not bm.has(it.seq_id)
                if new:
                    bm.allocate(it.seq_id, 0)
                grown.append((it.seq_id, bm.length(it.seq_id), new))
                bm.truncate(it.seq_id, it.start)
                bm.grow_to(it.seq_id, it.start + len(it.token_ids))
        except Exception:
            for seq_id, length, new in grown:
                if new:
                    bm.free(seq_id)
                else:
                    bm.truncate(seq_id, min(length, bm.length(seq_id)))
            raise
