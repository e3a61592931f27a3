from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specsplit.kv.block_manager import BlockManager, OutOfBlocks


def test_allocate_append_truncate_free():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate("a", 5)  # 2 blocks
    assert bm.num_free_blocks == 6 and bm.length("a") == 5
    bm.append("a", 4)  # 9 tokens -> 3 blocks (lookahead reservation)
    assert bm.num_free_blocks == 5
    bm.truncate("a", 4)  # rejected drafts: back to 1 block
    assert bm.num_free_blocks == 7 and bm.length("a") == 4
    slots = bm.slots("a", 0, 4)
    assert len(set(slots)) == 4 and all(s // 4 == bm.block_table("a")[0] for s in slots)
    bm.free("a")
    assert bm.num_free_blocks == 8


def test_out_of_blocks_is_an_error_and_changes_nothing():
    bm = BlockManager(num_blocks=3, block_size=4)
    bm.allocate("a", 8)
    with pytest.raises(OutOfBlocks, match="needs 2 more KV blocks"):
        bm.allocate("b", 5)
    assert not bm.has("b") and bm.num_free_blocks == 1
    with pytest.raises(OutOfBlocks):
        bm.grow_to("a", 20)
    assert bm.length("a") == 8 and bm.num_free_blocks == 1


def test_duplicate_sequence_rejected():
    bm = BlockManager(4, 4)
    bm.allocate("a", 1)
    with pytest.raises(KeyError):
        bm.allocate("a", 1)


ops = st.lists(
    st.tuples(st.sampled_from(["alloc", "append", "truncate", "free"]), st.integers(0, 5), st.integers(0, 40)),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_free_count_returns_to_start(sequence):
    bm = BlockManager(num_blocks=16, block_size=4)
    for op, sid, n in sequence:
        seq = f"s{sid}"
        try:
            if op == "alloc" and not bm.has(seq):
                bm.allocate(seq, n)
            elif op == "append" and bm.has(seq):
                bm.append(seq, n)
            elif op == "truncate" and bm.has(seq):
                bm.truncate(seq, n)
            elif op == "free":
                bm.free(seq)
        except OutOfBlocks:
            pass
        # invariant: blocks in tables + free blocks == all blocks, no block owned twice
        owned = [b for s in bm.seq_ids() for b in bm.block_table(s)]
        assert len(owned) == len(set(owned))
        assert len(owned) + bm.num_free_blocks == 16
        for s in bm.seq_ids():
            assert len(bm.block_table(s)) == bm.blocks_for(bm.length(s))
    for s in bm.seq_ids():
        bm.free(s)
    assert bm.num_free_blocks == 16


# ---- automatic prefix caching ---------------------------------------------------------------------
def _ids(n: int, offset: int = 0) -> list[int]:
    return [offset + i for i in range(n)]


def test_prefix_reused_by_reference_and_counted():
    """A second prompt sharing 2 full blocks with a registered one gets those very blocks (shared,
    not copied), and the hit is counted; its own blocks are fresh."""
    bm = BlockManager(num_blocks=16, block_size=4, prefix_caching=True)
    a = _ids(10)
    assert bm.allocate("a", 10, a) == 0
    bm.cache_prefix("a", a, 10)  # 2 full blocks final
    b = _ids(8) + [99, 98, 97]
    assert bm.allocate("b", 11, b) == 8
    assert bm.block_table("b")[:2] == bm.block_table("a")[:2]
    assert bm.block_table("b")[2] not in bm.block_table("a")
    assert bm.prefix_queried_tokens == 21 and bm.prefix_hit_tokens == 8
    assert bm.num_free_blocks == 16 - 3 - 1  # a: 3 blocks, b: 1 more of its own


def test_never_the_block_of_the_last_token():
    """A prompt that is exactly a cached prefix recomputes its last block (the step needs the last
    token's logits, and a shared block is never written)."""
    bm = BlockManager(num_blocks=8, block_size=4, prefix_caching=True)
    p = _ids(8)
    bm.allocate("a", 8, p)
    bm.cache_prefix("a", p, 8)
    assert bm.allocate("b", 8, p) == 4
    assert bm.block_table("b")[0] == bm.block_table("a")[0] and bm.block_table("b")[1] != bm.block_table("a")[1]


def test_released_blocks_stay_cached_until_evicted_lru():
    """Freed registered blocks count as free and keep their KV; a fresh block is taken from the
    never-registered ones first, then the least recently used cached one is evicted."""
    bm = BlockManager(num_blocks=4, block_size=2, prefix_caching=True)
    old, new = [1, 2, 3], [5, 6, 7]
    for sid, p in (("old", old), ("new", new)):
        bm.allocate(sid, 3, p)
        bm.cache_prefix(sid, p, 3)
        bm.free(sid)
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 2
    assert bm.num_used_blocks == 0  # used + free = all (the metrics' two states)
    bm.allocate("x", 4, [9, 9, 9, 9])  # 2 fresh blocks: the 2 never-registered ones
    assert bm.num_used_blocks == 2 and bm.num_free_blocks == 2
    assert bm.num_cached_blocks == 2
    bm.append("x", 2)  # one more: evicts the oldest cached block ("old"'s)
    assert bm.num_cached_blocks == 1
    bm.free("x")
    assert bm.allocate("old2", 3, old) == 0 and bm.allocate("new2", 3, new) == 2


def test_truncating_into_a_final_prefix_is_refused():
    bm = BlockManager(num_blocks=8, block_size=4, prefix_caching=True)
    p = _ids(9)
    bm.allocate("a", 9, p)
    bm.cache_prefix("a", p, 9)
    bm.truncate("a", 8)  # the partial third block: fine
    with pytest.raises(ValueError, match="final"):
        bm.truncate("a", 7)


def test_off_by_default_nothing_reused():
    bm = BlockManager(num_blocks=8, block_size=4)
    p = _ids(9)
    bm.allocate("a", 9, p)
    bm.cache_prefix("a", p, 9)
    assert bm.allocate("b", 9, p) == 0 and bm.num_cached_blocks == 0


cached_ops = st.lists(
    st.tuples(st.sampled_from(["alloc", "append", "cache", "truncate", "free"]), st.integers(0, 4), st.integers(0, 24),
              st.integers(0, 2)),
    max_size=80,
)


@settings(max_examples=200, deadline=None)
@given(cached_ops)
def test_prefix_cache_refcounts_and_free_count_return_to_start(sequence):
    """Random allocations over 3 prompt families, registrations, truncations (never into a final
    prefix) and frees: every block is owned, free or cached-and-evictable exactly as its reference
    count says; a registered block's hash names its prefix; all blocks come back."""
    bm = BlockManager(num_blocks=16, block_size=4, prefix_caching=True)
    prompts = {f: [f * 100 + i for i in range(40)] for f in range(3)}
    tokens: dict[str, list[int]] = {}
    for op, sid, n, fam in sequence:
        seq = f"s{sid}"
        try:
            if op == "alloc" and not bm.has(seq) and n > 0:
                tokens[seq] = prompts[fam][:n]
                cached = bm.allocate(seq, n, tokens[seq])
                assert cached % 4 == 0 and cached < n
            elif op == "append" and bm.has(seq):
                bm.append(seq, n)
            elif op == "cache" and bm.has(seq):
                bm.cache_prefix(seq, tokens[seq], min(n, len(tokens[seq])))
            elif op == "truncate" and bm.has(seq):
                floor = len(bm._seqs[seq].hashes) * 4
                bm.truncate(seq, max(n, floor))
            elif op == "free":
                bm.free(seq)
        except OutOfBlocks:
            pass
        owned = [b for s in bm.seq_ids() for b in bm.block_table(s)]
        for b in range(16):
            assert owned.count(b) == bm._refs[b]
        assert len(set(owned)) + bm.num_free_blocks == 16
        for h, b in bm._block_of.items():
            assert bm._hash_of[b] == h
    for s in bm.seq_ids():
        bm.free(s)
    assert bm.num_free_blocks == 16 and all(r == 0 for r in bm._refs)
