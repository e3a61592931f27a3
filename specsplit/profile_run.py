"""The profile run: the real engine code at the largest forwards the scheduler may form.

A TargetEngine (verify, resolve) or DraftEngine (propose, fetch_rows) runs over a ProfileRunner:
the real model and a small scratch KV cache, but every sequence is presented to attention as if
it sat at `max_model_len` tokens of context. Block tables cycle through the sequence's few
scratch blocks, so attention gathers (and masks, and scores) full-length contexts while the
scratch cache stays a few blocks big. Allocation sizes are those of a real forward at that
context; only the values differ. Sampling runs with temperature, top-k and top-p on (the costliest
path: a sort over the vocabulary per row), so the probability rows each step keeps are counted.

The step's first forward is the largest the scheduler may form (N = max_num_seqs, w = k+1,
P = max_prefill_tokens): N sequences of w new tokens each and one prompt chunk of P tokens.
BoundedRunner keeps every real forward within it (at most N sequences, their prompt pieces P
tokens together), so this one forward bounds them all: as many tokens or more, the widest
attention group (N x max_model_len gathered), the longest chunk, the most logit rows. The rest of
the step (sampling, the rows kept for the next call, the drafter's k-1 further forwards) follows.
"""
from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import torch

from specsplit.models.bounded_runner import BoundedRunner, ForwardBound
from specsplit.models.attention import BatchMetadata
from specsplit.models.llama import LlamaForCausalLM
from specsplit.models.runner import ForwardItem
from specsplit.protocols import ProposeRequest, QRow, RowRequest, SeqAdd, VerifyRequest
from specsplit.sampling.params import SamplingParams

PROFILE_PARAMS = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=1234, coupling=False)  # q rows + resolve


class ProfileRunner(BoundedRunner):
    """Real forwards at full context over a scratch cache of a few blocks, never split."""

    def forward(self, items: list[ForwardItem]) -> list[torch.Tensor]:
        return self._forward_group(list(items))

    def _forward_group(self, items: list[ForwardItem]) -> list[torch.Tensor]:
        bm = self.block_manager
        for it in items:
            if not bm.has(it.seq_id):
                bm.allocate(it.seq_id, 0)
            bm.truncate(it.seq_id, it.start)
            bm.grow_to(it.seq_id, it.start + len(it.token_ids))
        ctx = self.max_model_len
        per_seq = bm.blocks_for(ctx)
        tables, slots = [], []
        for it in items:
            own = bm.block_table(it.seq_id)
            tables.append(list(itertools.islice(itertools.cycle(own), per_seq)))
            slots.extend(bm.slots(it.seq_id, it.start, it.start + len(it.token_ids)))
        meta = BatchMetadata.build(
            q_lens=[len(it.token_ids) for it in items],
            kv_lens=[ctx] * len(items),
            block_tables=tables,
            slot_mapping=slots,
            logits_per_seq=[it.num_logits for it in items],
            block_size=bm.block_size,
            device=self.device,
        )
        input_ids = torch.tensor([t for it in items for t in it.token_ids], dtype=torch.int64, device=self.device)
        logits = self.model(input_ids, meta, self.kv)
        return list(logits.split([it.num_logits for it in items]))


@dataclass(frozen=True)
class ProfileShape:
    name: str
    new_tokens: tuple[int, ...]  # new tokens of each sequence in the step's first forward


def profile_shapes(bound: ForwardBound, max_model_len: int) -> list[ProfileShape]:
    n, w = bound.max_num_seqs, bound.window
    p = min(bound.max_prefill_tokens, max_model_len - 1)
    chunk = (p,) if p > w else ()
    return [ProfileShape("largest", (w,) * n + chunk)]


def scratch_blocks(bound: ForwardBound, block_size: int, max_model_len: int) -> int:
    """Scratch blocks that hold every profile shape's new tokens (each sequence its own blocks)."""
    blocks = 0
    for shape in profile_shapes(bound, max_model_len):
        blocks = max(blocks, sum(-(-(q + 1) // block_size) for q in shape.new_tokens))
    return blocks + 1


def make_profile_runner(model: LlamaForCausalLM, block_size: int, max_model_len: int, bound: ForwardBound) -> ProfileRunner:
    return ProfileRunner(model, scratch_blocks(bound, block_size, max_model_len), block_size, max_model_len, bound)


def _ids(rng: random.Random, vocab: int, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(vocab) for _ in range(n))


def run_verifier_shape(engine, shape: ProfileShape, k: int, seed: int = 0) -> None:
    """One verification step of `shape` through a TargetEngine: add, verify (sampled), resolve, release."""
    from specsplit.engine import TargetEngine

    assert isinstance(engine, TargetEngine)
    rng = random.Random(seed)
    vocab = engine.vocab_size
    ids = [f"profile-{shape.name}-{i}" for i in range(len(shape.new_tokens))]
    room = engine.runner.max_model_len - k - 1  # prompt + k drafts + 1 stay within max_model_len
    engine.add([SeqAdd(s, _ids(rng, vocab, max(1, min(q - k, room))), PROFILE_PARAMS) for s, q in zip(ids, shape.new_tokens)])
    try:
        reqs = [VerifyRequest(s, _ids(rng, vocab, k), (0.5,) * k) for s in ids]
        results = engine.verify(reqs)
        pending = [r for r in results if r.pending_position is not None]
        if pending:
            uniform = torch.full((vocab,), 1.0 / vocab)
            engine.resolve([QRow(r.seq_id, uniform) for r in pending])
    finally:
        engine.release(ids)


def run_drafter_shape(engine, shape: ProfileShape, k: int, seed: int = 0) -> None:
    """One draft step of `shape` through a DraftEngine: add, propose k (sampled), fetch_rows, release."""
    from specsplit.engine import DraftEngine

    assert isinstance(engine, DraftEngine)
    rng = random.Random(seed)
    vocab = engine.vocab_size
    ids = [f"profile-{shape.name}-{i}" for i in range(len(shape.new_tokens))]
    room = engine.runner.max_model_len - max(k, 1) - 1  # prompt + k drafts stay within max_model_len
    engine.add([SeqAdd(s, _ids(rng, vocab, max(1, min(q, room))), PROFILE_PARAMS) for s, q in zip(ids, shape.new_tokens)])
    try:
        engine.propose([ProposeRequest(s, (), k) for s in ids])
        engine.fetch_rows([RowRequest(ids[0], 0)] if k > 0 else [])
    finally:
        engine.release(ids)
