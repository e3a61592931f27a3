"""Suffix drafting (`--draft suffix`, `MODEL+suffix`): drafts from what came before, no model.

After SuffixDecoding (Oliaro et al., NeurIPS 2025): the drafter keeps next-token counts after every
n-gram (n = 1..max_depth) of (a) each request's own prompt and output so far and (b) a bounded
cache of recent finished outputs shared by every request the drafter serves -- in the drafter
service, every session, so every gateway. Those counts are what a suffix tree of depth
max_depth + 1 holds at its nodes. To draft, it matches the longest suffix of the context that
occurred before, takes the most frequent next token, appends it and repeats; the estimated
probability of the path (the product of count / total at each node) decides how far it goes: it
stops below `min_prob`, so a frequent match speculates many tokens and a rare one few.

Sharing (`--suffix-share`): `finished` (default) adds a request's output to the shared cache when
the request finished (stop or length: `release(..., finished=True)`), never its prompt and never a
live request's tokens; `none` keeps every lookup inside its own request. The cache holds at most
`--suffix-cache-tokens` output tokens, least recently added request evicted first.

Drafts are deterministic (q one-hot, q(x) = 1), as prompt lookup's: greedy, coupled and sampled
requests all stay lossless (the verifier resolves a rejection from p alone).
"""
from __future__ import annotations

import logging
import time
from array import array
from bisect import bisect_left
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from specsplit.defaults import DEFAULT_SUFFIX_CACHE_TOKENS as DEFAULT_CACHE_TOKENS
from specsplit.defaults import SUFFIX_SHARE_MODES as SHARE_MODES
from specsplit.draft_tree import chain_with_leaves
from specsplit.engine import EngineError, check_propose, check_seq_adds
from specsplit.protocols import DrafterTraits, Proposal, ProposeRequest, QRow, RowRequest, SeqAdd

log = logging.getLogger(__name__)

DEFAULT_MAX_DEPTH = 8  # longest suffix matched (tokens)
DEFAULT_MIN_PROB = 0.1  # stop drafting when the path's estimated probability falls below


SEP = -1  # between outputs in the shared cache: no match crosses it


def _match(arr: np.ndarray, context: Sequence[int], max_depth: int,
           last_at: np.ndarray | None = None) -> tuple[np.ndarray, int]:
    """Where the longest suffix of `context` (at most max_depth tokens) ends in `arr` with a token
    after it: (those end positions, the match length); (empty, 0) when the last token never
    occurred. arr [L] int64; last_at [C]: where context[-1] occurs in arr, when an index knows
    (else arr is scanned)."""
    if arr.size < 2 or not context:
        return np.empty(0, dtype=np.int64), 0
    if last_at is None:
        pos = np.flatnonzero(arr[:-1] == context[-1])  # [C] candidate ends with a next token
    else:
        pos = last_at[last_at < arr.size - 1]
    if pos.size == 0:
        return pos, 0
    length = 1
    for n in range(2, min(max_depth, len(context)) + 1):
        prev = pos - (n - 1)
        ok = prev >= 0
        keep = pos[ok][arr[prev[ok]] == context[-n]]
        if keep.size == 0:
            break
        pos, length = keep, n
    return pos, length


def _walk(arr: np.ndarray, ends: np.ndarray, k: int, min_prob: float,
          alternatives: list | None = None) -> tuple[list[int], float]:
    """From the matched ends, follow the most frequent next token (the suffix tree's heaviest
    child) while the path's probability stays >= min_prob: (drafts, their expected accepted count).
    alternatives (a list): receives per draft (its share of the continuations there, the second
    heaviest child or -1), for a draft tree's leaves (draft_tree.chain_with_leaves)."""
    out: list[int] = []
    p, expected = 1.0, 0.0
    for _ in range(k):
        ends = ends[ends + 1 < arr.size]
        if ends.size == 0:
            break
        nxt = arr[ends + 1]  # [C]
        nxt_ok = nxt[nxt != SEP]
        if nxt_ok.size == 0:
            break
        tokens, counts = np.unique(nxt_ok, return_counts=True)
        best = int(np.argmax(counts))
        p *= counts[best] / ends.size
        if p < min_prob:
            break
        token = int(tokens[best])
        out.append(token)
        expected += p
        if alternatives is not None:
            share = float(counts[best] / ends.size)  # this draft's share of the continuations
            counts[best] = 0
            second = int(np.argmax(counts))
            alternatives.append((share, int(tokens[second]) if counts[second] > 0 else -1))
        ends = ends[nxt == token] + 1
    return out, expected


def draft_from(sources: Sequence, context: Sequence[int], k: int, max_depth: int,
               min_prob: float, alternatives: list | None = None, min_match: int = 1) -> tuple[list[int], float]:
    """Up to k drafts continuing `context` from the source with the longest suffix match (ties: the
    more frequent continuation). sources: token arrays [L] (scanned) or SharedOutputs (indexed).
    min_match: a source whose longest match is shorter drafts nothing.
    Returns (drafts, expected number accepted); alternatives (a list): as _walk's, of those drafts."""
    best: tuple[list[int], float] = ([], 0.0)
    best_alts: list = []
    best_key = (0, 0.0)
    for source in sources:
        if isinstance(source, SharedOutputs):
            arr, last_at = source.arr, source.positions_of(context[-1]) if context else None
        else:
            arr, last_at = source, None
        ends, length = _match(arr, context, max_depth, last_at)
        if length == 0 or length < min_match:
            continue
        alts: list | None = [] if alternatives is not None else None
        drafts, expected = _walk(arr, ends, k, min_prob, alts)
        if (length, expected) > best_key:
            best, best_key, best_alts = (drafts, expected), (length, expected), alts
    if alternatives is not None:
        alternatives.extend(best_alts or [])
    return best


class SharedOutputs:
    """The bounded cache of finished outputs every request drafts from: one array, outputs joined
    by SEP, the oldest dropped from the front past `max_tokens` (first in, first out), and where
    each token occurs (absolute positions, so dropping the front moves nothing), so a lookup reads
    the occurrences of the context's last token instead of scanning the cache."""

    def __init__(self, max_tokens: int = DEFAULT_CACHE_TOKENS):
        self.max_tokens = max_tokens
        self.arr = np.empty(0, dtype=np.int64)  # [L] tokens from absolute position `base`
        self.base = 0
        self.outputs = 0
        self._where: dict[int, array] = {}  # token -> absolute positions, increasing (stale: < base)

    def add(self, output: Sequence[int]) -> None:
        if len(output) < 2 or self.max_tokens <= 0:
            return
        tokens = list(output)[-self.max_tokens + 1:]
        start = self.base + self.arr.size
        for i, t in enumerate(tokens):
            where = self._where.get(t)
            if where is None:
                where = self._where[t] = array("q")
            where.append(start + i)
        arr = np.concatenate([self.arr, np.asarray(tokens + [SEP], dtype=np.int64)])
        if arr.size > self.max_tokens:
            seps = np.flatnonzero(arr[: arr.size - self.max_tokens + 1] == SEP)
            cut = int(seps[-1]) + 1 if seps.size else arr.size - self.max_tokens
            self.outputs -= int(seps.size)
            arr = arr[cut:]
            self.base += cut
        self.arr = arr
        self.outputs += 1

    def positions_of(self, token: int) -> np.ndarray:
        """Where `token` occurs in arr (indices into arr) [C] int64."""
        where = self._where.get(token)
        if where is None:
            return np.empty(0, dtype=np.int64)
        stale = bisect_left(where, self.base)
        if stale:
            del where[:stale]
            if not where:
                del self._where[token]
                return np.empty(0, dtype=np.int64)
        return np.frombuffer(where, dtype=np.int64) - self.base

    @property
    def num_tokens(self) -> int:
        return int(self.arr.size)


@dataclass
class _SSeq:
    tokens: list[int]  # prompt + every final token
    prompt_len: int


class SuffixDrafter(DrafterTraits):
    """The Drafter protocol over suffix lookups (own context + the shared cache of outputs)."""

    side = "drafter"

    def __init__(self, vocab_size: int | None = None, max_model_len: int | None = None,
                 cache_tokens: int = DEFAULT_CACHE_TOKENS, share: str = "finished",
                 max_depth: int = DEFAULT_MAX_DEPTH, min_prob: float = DEFAULT_MIN_PROB):
        if share not in SHARE_MODES:
            raise ValueError(f"--suffix-share must be one of {', '.join(SHARE_MODES)}, got {share!r}")
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.share = share
        self.max_depth = max_depth
        self.min_prob = min_prob
        self.shared = SharedOutputs(cache_tokens if share != "none" else 0)
        self.seqs: dict[str, _SSeq] = {}
        # metrics: drafting steps that proposed, tokens proposed, seconds spent (lookups + updates)
        self.proposals = 0
        self.proposed_tokens = 0
        self.busy_s = 0.0

    @property
    def num_running(self) -> int:
        return len(self.seqs)

    @property
    def suffix(self) -> "SuffixDrafter":
        return self

    # ---- the lookup a hybrid drafter uses too -----------------------------------------------
    def start(self, seq_id: str, prompt: Sequence[int]) -> None:
        self.seqs[seq_id] = _SSeq(list(prompt), len(prompt))

    def extend(self, seq_id: str, new: Sequence[int]) -> None:
        self.seqs[seq_id].tokens.extend(new)

    def draft(self, seq_id: str, k: int, pending: Sequence[int] = (),
              alternatives: list | None = None, min_match: int = 1) -> tuple[list[int], float]:
        """Up to k drafts after the sequence's tokens + `pending` (drafts being verified now), and
        their expected accepted count; alternatives, min_match: as draft_from's."""
        if k <= 0:
            return [], 0.0
        t0 = time.perf_counter()
        context = self.seqs[seq_id].tokens + list(pending)
        own = np.asarray(context, dtype=np.int64)  # [L] this request's prompt + output (+ pending)
        sources = [own, self.shared] if self.shared.outputs else [own]
        drafts, expected = draft_from(sources, context, k, self.max_depth, self.min_prob, alternatives, min_match)
        self.busy_s += time.perf_counter() - t0
        if drafts:
            self.proposals += 1
            self.proposed_tokens += len(drafts)
        return drafts, expected

    def finish(self, seq_id: str, finished: bool) -> None:
        s = self.seqs.pop(seq_id, None)
        if s is not None and finished and self.share == "finished":
            t0 = time.perf_counter()
            self.shared.add(s.tokens[s.prompt_len:])
            self.busy_s += time.perf_counter() - t0

    # ---- the Drafter protocol ---------------------------------------------------------------
    def add(self, seqs: Sequence[SeqAdd]) -> None:
        check_seq_adds(seqs, self.seqs, self.side, self.vocab_size, self.max_model_len)
        for s in seqs:
            self.start(s.seq_id, s.prompt_token_ids)

    def propose(self, reqs: Sequence[ProposeRequest]) -> list[Proposal]:
        for r in reqs:
            if r.seq_id not in self.seqs:
                raise EngineError(f"unknown sequence {r.seq_id!r} on the drafter: add it first")
            check_propose(r, self.seqs[r.seq_id], self.vocab_size, self.max_model_len or 1 << 62)
        out = []
        for r in reqs:
            t0 = time.perf_counter()
            self.extend(r.seq_id, r.new_token_ids)
            self.busy_s += time.perf_counter() - t0
            alternatives: list | None = [] if r.tree_nodes > 0 and not r.pending_drafts else None
            drafts, _ = self.draft(r.seq_id, r.k, r.pending_drafts, alternatives)
            if alternatives:  # a tree: the heaviest path plus the second heaviest child where it was unsure
                tree = chain_with_leaves(drafts, alternatives, r.tree_nodes)
                if not tree.is_chain:
                    out.append(Proposal(r.seq_id, tree.tokens, tuple(1.0 for _ in tree.tokens), tree.parents))
                    continue
            out.append(Proposal(r.seq_id, tuple(drafts), tuple(1.0 for _ in drafts)))
        return out

    def fetch_rows(self, fetch: Sequence[RowRequest]) -> list[QRow]:
        if fetch:
            raise EngineError("the suffix drafter's q rows are one-hot; the verifier resolves them itself")
        return []

    def release(self, seq_ids: Sequence[str], finished: bool = False) -> None:
        for seq_id in seq_ids:
            self.finish(seq_id, finished)

    def describe(self) -> str:
        return (f"suffix drafter: depth {self.max_depth}, min path probability {self.min_prob}, share "
                f"{self.share}, shared cache {self.shared.num_tokens}/{self.shared.max_tokens} tokens "
                f"({self.shared.outputs} outputs; at most {self.shared.max_tokens * 8 / 2**20:.1f} MiB)")
