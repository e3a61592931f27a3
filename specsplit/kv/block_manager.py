"""BlockManager: which KV-cache blocks each sequence owns. Pure Python, no tensors.

A sequence's KV occupies `length` token slots; slot i lives in block table[i // block_size] at
offset i % block_size. Growing a sequence (a prompt, a decode token, k+1 lookahead slots for
verification) takes blocks from the free list; truncating it (rejected drafts) gives whole blocks
back. Running out of blocks raises OutOfBlocks and changes nothing.

Automatic prefix caching (prefix_caching=True): a full block whose KV is final (`cache_prefix`)
is registered under the hash of its tokens chained with its parent block's hash, so the hash names
the whole prefix up to it. `allocate` with the prompt's tokens reuses the longest run of
registered blocks from the start (reference counts: a block is shared, never copied) and returns
how many tokens are already computed. A block nobody holds keeps its KV and its hash in an LRU
list: it counts as free, and is evicted (its hash forgotten) only when a fresh block is needed and
no never-registered one is left. A shared block is never written: a reused prefix stops before the
prompt's last token (whose logits the first step needs), and only final tokens are registered
(drafts and the current step's tokens never are).
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence


class OutOfBlocks(RuntimeError):
    """Not enough free KV blocks for the request; nothing was allocated."""


@dataclass
class _SeqBlocks:
    table: list[int] = field(default_factory=list)
    length: int = 0  # token slots in use
    hashes: list[bytes] = field(default_factory=list)  # prefix caching: hashes of table[:len(hashes)]


def too_few_blocks(num_blocks: int, block_size: int, max_model_len: int, owner: str = "") -> str | None:
    """Why a cache of --num-blocks cannot hold one --max-model-len sequence (None: it can). The one
    message for the CLI, before any model loads, and for the memory plan (`owner`: its service)."""
    need = -(-max_model_len // block_size)
    if num_blocks >= need:
        return None
    return (f"--num-blocks {num_blocks} x --block-size {block_size} = {num_blocks * block_size} tokens of KV cache"
            f"{f' ({owner})' if owner else ''}, but one sequence of --max-model-len {max_model_len} tokens needs "
            f"{need} blocks. Raise --num-blocks to at least {need} (0 sizes it from the memory budget), or lower "
            "--max-model-len.")


def block_hash(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """The content hash of one full block: its token ids chained with the parent block's hash (so
    equal hashes mean equal prefixes). 128-bit BLAKE2b: a collision would serve another prompt's KV."""
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(b"".join(int(t).to_bytes(4, "little", signed=True) for t in tokens))
    return h.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int = 16, prefix_caching: bool = False):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        # Stack of free block ids holding no registered KV; popping from the end hands out low ids first.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._seqs: dict[str, _SeqBlocks] = {}
        self._refs = [0] * num_blocks  # sequences holding each block
        self._hash_of: dict[int, bytes] = {}  # registered block -> its hash
        self._block_of: dict[bytes, int] = {}  # hash -> registered block
        self._evictable: OrderedDict[int, None] = OrderedDict()  # registered, held by nobody; oldest first
        self.prefix_queried_tokens = 0  # prompt tokens looked up (allocate with tokens)
        self.prefix_hit_tokens = 0  # ... found computed in the cache

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence can take: never-registered ones plus cached ones nobody holds."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Registered blocks (held or not): what a new prompt can reuse."""
        return len(self._block_of)

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else 0.0

    @property
    def num_used_blocks(self) -> int:
        """Blocks sequences hold: used + free = num_blocks (a cached block nobody holds is free)."""
        return self.num_blocks - self.num_free_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def has(self, seq_id: str) -> bool:
        return seq_id in self._seqs

    def length(self, seq_id: str) -> int:
        return self._seqs[seq_id].length

    def block_table(self, seq_id: str) -> list[int]:
        return self._seqs[seq_id].table

    def can_grow(self, seq_id: str | None, num_tokens: int) -> bool:
        """Whether the sequence (or a new one, seq_id None) could hold num_tokens slots in total."""
        have = len(self._seqs[seq_id].table) if seq_id in self._seqs else 0
        return self.blocks_for(num_tokens) - have <= self.num_free_blocks

    def slot(self, seq_id: str, position: int) -> int:
        seq = self._seqs[seq_id]
        if not 0 <= position < seq.length:
            raise IndexError(f"position {position} outside sequence {seq_id!r} of length {seq.length}")
        return seq.table[position // self.block_size] * self.block_size + position % self.block_size

    def slots(self, seq_id: str, start: int, end: int) -> list[int]:
        seq = self._seqs[seq_id]
        if not 0 <= start <= end <= seq.length:
            raise IndexError(f"slots [{start}, {end}) outside sequence {seq_id!r} of length {seq.length}")
        bs, table = self.block_size, seq.table
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    # ---- lifecycle -----------------------------------------------------------------------
    def allocate(self, seq_id: str, num_tokens: int, token_ids: Sequence[int] | None = None) -> int:
        """Register a new sequence holding num_tokens slots (its prompt). With prefix caching and
        the prompt's token_ids: reuse the registered blocks of its longest cached prefix (never the
        block of its last token). Returns the leading tokens whose KV is already computed."""
        if seq_id in self._seqs:
            raise KeyError(f"sequence {seq_id!r} already has blocks")
        seq = self._seqs[seq_id] = _SeqBlocks()
        if self.prefix_caching and token_ids:
            self.prefix_queried_tokens += len(token_ids)
            parent = None
            for i in range((len(token_ids) - 1) // self.block_size):  # full blocks before the last token
                h = block_hash(parent, token_ids[i * self.block_size:(i + 1) * self.block_size])
                b = self._block_of.get(h)
                if b is None:
                    break
                self._hold(b)
                seq.table.append(b)
                seq.hashes.append(h)
                parent = h
            seq.length = len(seq.table) * self.block_size
        try:
            self.grow_to(seq_id, num_tokens)
        except OutOfBlocks:
            self.free(seq_id)
            raise
        cached = len(seq.hashes) * self.block_size
        self.prefix_hit_tokens += cached
        return cached

    def cache_prefix(self, seq_id: str, token_ids: Sequence[int], num_tokens: int) -> None:
        """The KV of token_ids[:num_tokens] is final (computed, and never rolled back): register
        the full blocks in it, so later prompts with the same prefix reuse them."""
        if not self.prefix_caching:
            return
        seq = self._seqs[seq_id]
        full = min(num_tokens, seq.length, len(token_ids)) // self.block_size
        while len(seq.hashes) < full:
            i = len(seq.hashes)
            h = block_hash(seq.hashes[-1] if seq.hashes else None, token_ids[i * self.block_size:(i + 1) * self.block_size])
            seq.hashes.append(h)
            b = seq.table[i]
            if h not in self._block_of and b not in self._hash_of:
                self._block_of[h] = b
                self._hash_of[b] = h
            # else: another block holds this prefix already (two prompts computed it at once); this
            # one stays private and returns to the free list when released

    def grow_to(self, seq_id: str, num_tokens: int) -> None:
        """Make the sequence hold at least num_tokens slots (append, lookahead reservation)."""
        seq = self._seqs[seq_id]
        if num_tokens <= seq.length:
            return
        need = self.blocks_for(num_tokens) - len(seq.table)
        if need > self.num_free_blocks:
            raise OutOfBlocks(
                f"sequence {seq_id!r} needs {need} more KV blocks for {num_tokens} tokens, "
                f"{self.num_free_blocks} of {self.num_blocks} are free"
            )
        for _ in range(need):
            seq.table.append(self._take())
        seq.length = num_tokens

    def append(self, seq_id: str, num_tokens: int = 1) -> None:
        self.grow_to(seq_id, self._seqs[seq_id].length + num_tokens)

    def truncate(self, seq_id: str, num_tokens: int) -> None:
        """Shrink the sequence to its first num_tokens slots, freeing whole blocks past them."""
        seq = self._seqs[seq_id]
        if num_tokens < 0:
            raise ValueError(f"cannot truncate to {num_tokens} tokens")
        if num_tokens >= seq.length:
            return
        if num_tokens < len(seq.hashes) * self.block_size:
            # Only final tokens are registered, and those are never rolled back: a caller that does
            # would write into a block other sequences may read.
            raise ValueError(f"sequence {seq_id!r}: cannot truncate to {num_tokens} tokens, its first "
                             f"{len(seq.hashes) * self.block_size} are final (cached prefix)")
        keep = self.blocks_for(num_tokens)
        while len(seq.table) > keep:
            self._release(seq.table.pop())
        seq.length = num_tokens

    def free(self, seq_id: str) -> None:
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return
        while seq.table:
            self._release(seq.table.pop())

    def seq_ids(self) -> list[str]:
        return list(self._seqs)

    # ---- blocks ----------------------------------------------------------------------------
    def _take(self) -> int:
        """A block for new KV: a never-registered one, else the least recently used cached one
        (its hash is forgotten)."""
        if self._free:
            b = self._free.pop()
        else:
            b, _ = self._evictable.popitem(last=False)
            del self._block_of[self._hash_of.pop(b)]
        self._refs[b] = 1
        return b

    def _hold(self, b: int) -> None:
        if self._refs[b] == 0:
            del self._evictable[b]
        self._refs[b] += 1

    def _release(self, b: int) -> None:
        self._refs[b] -= 1
        if self._refs[b] == 0:
            if b in self._hash_of:
                self._evictable[b] = None  # newest last: evicted after every older one
            else:
                self._free.append(b)
