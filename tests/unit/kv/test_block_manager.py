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
