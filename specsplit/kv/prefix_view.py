"""What the scheduler knows of the verifier's prefix cache (kv/block_manager.py), without asking it.

The scheduler runs in the gateway, the cache in the verifier (in-process or over gRPC), so it keeps
its own record of the prompts whose blocks the verifier has registered: the same chained block
hashes, for the prompts it saw registered (a step began with the prompt computed, and that step's
verify registered it; or the request finished and its release did). Bounded like the cache (least
recently used forgotten first). The verifier may have evicted a block this view still holds: then
a request that trusted the view computes the block itself, as it would have without the view.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from specsplit.kv.block_manager import block_hash


def shared_blocks(tokens: Sequence[int], other: Sequence[int], block_size: int, most: int) -> int:
    """How many of the first `most` full blocks of `tokens` equal those of `other`."""
    n = 0
    while n < most and (n + 1) * block_size <= len(other) \
            and tuple(tokens[n * block_size:(n + 1) * block_size]) == tuple(other[n * block_size:(n + 1) * block_size]):
        n += 1
    return n


class PrefixView:
    def __init__(self, block_size: int, capacity: int):
        self.block_size = block_size
        self.capacity = max(1, capacity)  # block hashes kept: the verifier's block count
        self._hashes: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._hashes)

    def remember(self, tokens: Sequence[int]) -> None:
        """The verifier registered the full blocks of these computed tokens."""
        parent = None
        for i in range(len(tokens) // self.block_size):
            parent = block_hash(parent, tokens[i * self.block_size:(i + 1) * self.block_size])
            self._hashes[parent] = None
            self._hashes.move_to_end(parent)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)

    def cached_blocks(self, tokens: Sequence[int], most: int) -> int:
        """How many of the first `most` full blocks of `tokens` the verifier has registered (as far
        as this view knows)."""
        parent, n = None, 0
        while n < most and (n + 1) * self.block_size <= len(tokens):
            parent = block_hash(parent, tokens[n * self.block_size:(n + 1) * self.block_size])
            if parent not in self._hashes:
                break
            self._hashes.move_to_end(parent)
            n += 1
        return n
