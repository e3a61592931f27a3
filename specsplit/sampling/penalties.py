"""Penalties and logit_bias on the target's logits of one verify, row by row.

A verify scores k+1 positions of a sequence: row j is the position after the context and the
drafts d_0 .. d_{j-1}. Each row is penalized from the tokens before *its* position, so drafts the
same step verifies count for the rows after them, exactly as if the target alone had generated
them one by one (that is what makes speculation lossless here: row j equals what target-only
decoding computes at that position, given that the drafts before it are accepted, and it is only
read when they are).

Per row, in this order (what the target-only step applies too):
  1. repetition_penalty r (transformers' RepetitionPenaltyLogitsProcessor): every token seen in the
     prompt or generated so far: logit / r if logit > 0 else logit * r;
  2. OpenAI's penalties over the generated tokens (not the prompt):
     logit -= frequency_penalty * count + presence_penalty * (count > 0);
  3. logit_bias: logit += bias of that token id;
  4. min_tokens: while fewer than min_tokens tokens are generated before the row, the ids that
     would end the output (params.min_tokens_stop_ids) get -inf.
Then the grammar mask (specsplit.sampling.grammar), then temperature / top-k / top-p.
"""
from __future__ import annotations

from typing import Sequence

import torch

from specsplit.sampling.params import SamplingParams


def penalize(logits: torch.Tensor, params: SamplingParams, prompt: Sequence[int], generated: Sequence[int],
             drafts: Sequence[int] = ()) -> torch.Tensor:
    """logits [n, V] of one sequence (rows: positions after generated + drafts[:j], j < n) -> a new
    float32 tensor [n, V] with the penalties and biases of `params` applied; drafts has >= n - 1."""
    out = logits.float().clone()
    n, vocab = out.shape
    if not params.penalized_at(len(generated)) or n == 0:
        return out
    device = out.device
    if params.repetition_penalty != 1.0 or params.frequency_penalty or params.presence_penalty:
        gen = torch.as_tensor(list(generated), dtype=torch.int64)
        counts = torch.bincount(gen, minlength=vocab)[:vocab].to(device=device, dtype=torch.float32)  # [V]
        step = torch.zeros(n, vocab, dtype=torch.float32, device=device)  # [n, V]
        if n > 1:
            d = torch.as_tensor(list(drafts)[: n - 1], dtype=torch.int64, device=device)
            step[torch.arange(1, n, device=device), d] = 1.0
        counts = counts[None] + step.cumsum(0)  # [n, V]: generated tokens before each row
        if params.repetition_penalty != 1.0:
            seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            if len(prompt):
                seen[torch.as_tensor(list(prompt), dtype=torch.int64, device=device)] = True
            seen = seen[None] | (counts > 0)  # [n, V]
            r = params.repetition_penalty
            out = torch.where(seen, torch.where(out > 0, out / r, out * r), out)
        if params.frequency_penalty or params.presence_penalty:
            out = out - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.int64, device=device)
        bias = torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32, device=device)
        out[:, ids] += bias
    held = min(n, params.min_tokens - len(generated))  # rows 0 .. held-1 come before min_tokens
    if held > 0 and params.min_tokens_stop_ids:
        ids = torch.tensor(params.min_tokens_stop_ids, dtype=torch.int64, device=device)
        out[:held, ids] = float("-inf")
    return out
