"""BlockManager: which KV-cache blocks each sequence owns. Pure Python, no tensors.

A sequence's KV occupies `length` token slots; slot i lives in block table[i // block_size] at
offset i % block_size. Growing a sequence (a prompt, a decode token, k+1 lookahead slots for
verification) takes blocks from the free list; truncating it (rejected drafts) gives whole blocks
back. Running out of blocks raises OutOfBlocks and changes nothing.
"""
from __future__ import annotations

from dataclasses import dataclass, field


class OutOfBlocks(RuntimeError):
    """Not enough free KV blocks for the request; nothing was allocated."""


@dataclass
class _SeqBlocks:
    table: list[int] = field(default_factory=list)
    length: int = 0  # token slots in use


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int = 16):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Stack of free block ids; popping from the end hands out low ids first.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._seqs: dict[str, _SeqBlocks] = {}

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

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
        return self.blocks_for(num_tokens) - have <= len(self._free)

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
    def allocate(self, seq_id: str, num_tokens: int) -> None:
        """Register a new sequence holding num_tokens slots (its prompt)."""
        if seq_id in self._seqs:
            raise KeyError(f"sequence {seq_id!r} already has blocks")
        self._seqs[seq_id] = _SeqBlocks()
        try:
            self.grow_to(seq_id, num_tokens)
        except OutOfBlocks:
            del self._seqs[seq_id]
            raise

    def grow_to(self, seq_id: str, num_tokens: int) -> None:
        """Make the sequence hold at least num_tokens slots (append, lookahead reservation)."""
        seq = self._seqs[seq_id]
        if num_tokens <= seq.length:
            return
        need = self.blocks_for(num_tokens) - len(seq.table)
        if need > len(self._free):
            raise OutOfBlocks(
                f"sequence {seq_id!r} needs {need} more KV blocks for {num_tokens} tokens, "
                f"{len(self._free)} of {self.num_blocks} are free"
            )
        for _ in range(need):
            seq.table.append(self._free.pop())
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
        keep = self.blocks_for(num_tokens)
        while len(seq.table) > keep:
            self._free.append(seq.table.pop())
        seq.length = num_tokens

    def free(self, seq_id: str) -> None:
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return
        while seq.table:
            self._free.append(seq.table.pop())

    def seq_ids(self) -> list[str]:
        return list(self._seqs)
