"""The scheduler's view of the verifier's prefix cache (kv/prefix_view.py): the same chained
block hashes as the block manager, full blocks only, least recently used forgotten first."""
from __future__ import annotations

from specsplit.kv.block_manager import BlockManager
from specsplit.kv.prefix_view import PrefixView, shared_blocks


def test_shared_blocks_counts_equal_full_blocks_from_the_start():
    a = tuple(range(40))
    assert shared_blocks(a, a, 16, 2) == 2
    assert shared_blocks(a, a[:20], 16, 2) == 1  # the other holds one full block
    assert shared_blocks(a, (99,) + a[1:], 16, 2) == 0
    assert shared_blocks(a, a[:16] + (99,) * 24, 16, 2) == 1
    assert shared_blocks(a, list(a), 16, 1) == 1  # at most `most`; a list compares as a tuple


def test_the_view_agrees_with_the_block_manager_on_what_a_registered_prompt_shares():
    prompt = tuple(3 + (j * 7) % 200 for j in range(50))  # 3 full blocks
    bm = BlockManager(16, block_size=16, prefix_caching=True)
    bm.allocate("a", len(prompt), prompt)
    bm.cache_prefix("a", prompt, len(prompt))
    view = PrefixView(16, 16)
    view.remember(prompt)
    for other in (prompt[:40] + (1,) * 9, prompt[:20] + (2,) * 30, (5,) + prompt[1:]):
        found = bm.allocate(f"x{len(bm.seq_ids())}", len(other), other) // 16
        assert view.cached_blocks(other, 8) == found
    assert view.cached_blocks(prompt, 2) == 2  # at most `most`


def test_least_recently_used_blocks_are_forgotten_past_the_capacity():
    view = PrefixView(4, 3)
    first, second = tuple(range(8)), tuple(range(100, 108))
    view.remember(first)  # 2 blocks
    view.remember(second)  # 2 more: the first prompt's first block goes
    assert len(view) == 3
    assert view.cached_blocks(first, 2) == 0 and view.cached_blocks(second, 2) == 2
