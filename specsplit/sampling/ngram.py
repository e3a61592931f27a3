"""Prompt-lookup (n-gram) drafting: propose the tokens that followed the last repeat of the suffix.

Drafts are a deterministic function of the context, so q(x) = 1 for each drafted token and the q
row is one-hot: rejection sampling with these drafts stays lossless (see ngram_q_rows).
"""

from __future__ import annotations

from typing import Sequence

import torch


def ngram_propose(
    token_ids: Sequence[int],
    k: int,
    n_min: int = 1,
    n_max: int = 4,
) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest suffix n-gram.

    n runs from n_max down to n_min; the first n with a match wins, and among its matches the most
    recent one (closest to the end) is used. [] when nothing matches or k <= 0.

    Cost: one backward scan over the context comparing the last token (O(len) cheap integer
    compares, early exit at the first full-length match), with the n-gram compared only where the
    last token matches. No per-call O(len**2) work.
    """
    if k <= 0:
        return []
    tokens = list(token_ids)
    best: tuple[int, int] | None = None  # (length matched, end): the longest, then the most recent
    for matched, end in _suffix_matches(tokens, n_min, n_max):
        if best is None or matched > best[0]:
            best = (matched, end)
            if matched >= min(n_max, len(tokens) - 1):
                break  # nothing earlier in the scan can beat the most recent full-length match
    return [] if best is None else tokens[best[1] + 1: best[1] + 1 + k]


def ngram_branches(
    token_ids: Sequence[int],
    k: int,
    max_branches: int,
    n_min: int = 1,
    n_max: int = 4,
) -> list[list[int]]:
    """Up to max_branches distinct continuations (k tokens at most each) of the context's suffix,
    the branches of a draft tree (specsplit.draft_tree): the tokens that followed earlier
    occurrences of the suffix n-gram, longest n first and, within an n, the most recent first. The
    first is ngram_propose's chain; a later one is kept only where it differs from every earlier
    one (not a prefix of one). [] when nothing matches."""
    if k <= 0 or max_branches <= 0:
        return []
    tokens = list(token_ids)
    matches = list(_suffix_matches(tokens, n_min, n_max))  # most recent first
    matches.sort(key=lambda m: -m[0])  # stable: the most recent first within a length
    out: list[list[int]] = []
    for _, end in matches:
        cont = tokens[end + 1: end + 1 + k]
        if cont and not any(b[:len(cont)] == cont for b in out):
            out.append(cont)
            if len(out) >= max_branches:
                break
    return out


def _suffix_matches(token_ids: Sequence[int], n_min: int, n_max: int):
    """(length matched, end index) of every earlier occurrence of the context's suffix n-gram with
    n_min <= length (counted up to n_max), scanning backwards: the most recent first. An
    occurrence must end before the suffix itself does (end <= len - 2). The cost: one backward
    scan comparing the last token (cheap integer compares), the n-gram only where it matches."""
    length = len(token_ids)
    n_max = min(n_max, length - 1)
    if n_min < 1 or n_max < n_min:
        return
    last = token_ids[-1]
    for end in range(length - 2, -1, -1):
        if token_ids[end] != last:
            continue
        matched = 1
        while matched < n_max and end - matched >= 0 and token_ids[end - matched] == token_ids[-1 - matched]:
            matched += 1
        if matched >= n_min:
            yield matched, end


def ngram_q_rows(
    draft_ids: torch.Tensor,  # [B, K] int64
    vocab_size: int,
) -> torch.Tensor:  # [B, K, V] float32 one-hot (q of a deterministic proposer)
    q = torch.zeros(*draft_ids.shape, vocab_size, dtype=torch.float32, device=draft_ids.device)
    return q.scatter_(-1, draft_ids.clamp(0, vocab_size - 1)[..., None].to(torch.int64), 1.0)
