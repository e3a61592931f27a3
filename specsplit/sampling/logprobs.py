"""Log-probabilities of emitted tokens under the target (GenerationRequest.logprobs).

The verifier already holds the target's logits of every position it emits a token at (the rows of
one verify: accepted drafts + the bonus / recovered token). For the sequences that asked, their
rows are stacked and go through one log_softmax and one topk, whatever the batch:

    rows   [R, V]  the target's logits (fp32), R = tokens emitted by the sequences that asked
    ids    [R]     the token emitted at each row
    n      [R]     alternatives wanted at each row (the sequence's `logprobs`, 0..20)

The values are the log_softmax of the raw logits: before temperature, top-k and top-p (what the
model thinks of the token, whatever the request sampled it with). Ties in topk are broken as
torch breaks them. Each token's rank is vLLM's: how many tokens are at least as likely as it
(1 = the most likely; a tie counts against it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

MAX_LOGPROBS = 20  # alternatives per token at most (the API's limit: specsplit.request.validate)
# Prompt log-probabilities (SeqAdd.prompt_logprobs) are scored this many prompt positions per
# forward: [32, V] fp32 logits and their log_softmax (12 MiB for SmolLM2's 49,152 tokens), about
# the rows one verify of 6 sequences at K = 4 holds, so a long prompt never holds a [P, V] tensor.
PROMPT_LOGITS_ROWS = 32


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's log-probability under the target (log_softmax of the target's fp32
    logits at that position, before temperature / top-k / top-p), and the `n` most likely tokens
    there with theirs, most likely first. (specsplit.protocols and specsplit.request re-export it.)"""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # ((token_id, logprob), ...), len n
    rank: int = 0  # tokens at least as likely, itself included (1 = the most likely); 0: not known


def token_logprobs(rows: torch.Tensor, ids: Sequence[int], n: Sequence[int]) -> list[TokenLogprob]:
    """rows [R, V] logits, ids [R], n [R] -> R TokenLogprobs (top: n[r] pairs, most likely first)."""
    if rows.dim() != 2 or rows.shape[0] != len(ids) or len(ids) != len(n):
        raise ValueError(f"rows {tuple(rows.shape)}, {len(ids)} ids, {len(n)} counts: expected [R, V], R, R")
    if not len(ids):
        return []
    lsm = torch.log_softmax(rows.float(), dim=-1)  # [R, V]
    index = torch.as_tensor(list(ids), dtype=torch.int64, device=lsm.device)  # [R]
    chosen_lp = lsm.gather(1, index[:, None])  # [R, 1]
    rank = (lsm >= chosen_lp).sum(-1).cpu().tolist()  # [R]
    chosen = chosen_lp[:, 0].cpu().tolist()  # [R]
    n_max = min(max(n), lsm.shape[1])
    if n_max > 0:
        top_lp, top_id = lsm.topk(n_max, dim=-1)  # [R, n_max] each, sorted most likely first
        top_lp, top_id = top_lp.cpu().tolist(), top_id.cpu().tolist()
    out = []
    for r, (t, lp) in enumerate(zip(ids, chosen)):
        top = tuple(zip(top_id[r][: n[r]], top_lp[r][: n[r]])) if n_max > 0 and n[r] > 0 else ()
        out.append(TokenLogprob(int(t), float(lp), top, int(rank[r])))
    return out


def seq_logprobs(rows: Sequence[torch.Tensor], ids: Sequence[Sequence[int]],
                 n: Sequence[int]) -> list[tuple[TokenLogprob, ...]]:
    """Per sequence: rows[i] [m_i, V] logits of the m_i positions where ids[i] (m_i tokens) were
    emitted, n[i] alternatives -> its m_i TokenLogprobs. One log_softmax + topk over all rows."""
    if not rows:
        return []
    sizes = [len(x) for x in ids]
    for r, m in zip(rows, sizes):
        if r.shape[0] != m:
            raise ValueError(f"{r.shape[0]} logit rows for {m} tokens")
    flat = token_logprobs(torch.cat(list(rows)), [t for x in ids for t in x],  # [sum m_i, V]
                          [k for k, m in zip(n, sizes) for _ in range(m)])
    out, at = [], 0
    for m in sizes:
        out.append(tuple(flat[at: at + m]))
        at += m
    return out
