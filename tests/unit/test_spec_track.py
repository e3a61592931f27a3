"""Track (specsplit/spec/track.py): the features a sequence holds for its drafter, kept as the steps
bring them, bounded, joined when taken."""
from __future__ import annotations

import torch

from specsplit.protocols import SeqAdd
from specsplit.spec.track import Track


def _rows(start: int, n: int) -> torch.Tensor:
    """[n, 4] rows whose first column is their position (exact in bf16 below 256)."""
    return torch.arange(start, start + n, dtype=torch.float32)[:, None].repeat(1, 4)


def _track() -> Track:
    return Track(add=SeqAdd("s", (1, 2, 3)), k=3, tokens=[1, 2, 3])


def test_pieces_that_follow_are_joined_when_taken():
    t = _track()
    t.add_features(10, _rows(10, 5), cap=100)
    t.add_features(15, _rows(15, 1), cap=100)
    t.add_features(16, _rows(16, 2), cap=100)
    assert t.feature_rows == 8 and len(t.feat_pieces) == 3
    rows, start = t.take_features()
    assert start == 10 and rows.dtype == torch.bfloat16 and torch.equal(rows[:, 0].float(), torch.arange(10.0, 18.0))
    assert t.take_features()[0] is None and t.feature_rows == 0


def test_the_oldest_rows_go_past_the_cap_and_a_gap_replaces_what_was_held():
    t = _track()
    t.add_features(0, _rows(0, 40), cap=64)
    for p in range(40, 100):  # one row a step while speculation is off
        t.add_features(p, _rows(p, 1), cap=64)
        assert t.feature_rows == min(64, p + 1)
    rows, start = t.take_features()
    assert start == 36 and rows.shape[0] == 64 and torch.equal(rows[:, 0].float(), torch.arange(36.0, 100.0))
    t.add_features(100, _rows(100, 3), cap=64)
    t.add_features(120, _rows(120, 2), cap=64)  # not after the rows held: they are dropped
    rows, start = t.take_features()
    assert start == 120 and torch.equal(rows[:, 0].float(), torch.tensor([120.0, 121.0]))
    t.add_features(0, _rows(0, 10), cap=4)  # one piece over the cap: its newest rows
    rows, start = t.take_features()
    assert start == 6 and torch.equal(rows[:, 0].float(), torch.arange(6.0, 10.0))


def test_losing_the_drafter_drops_the_rows():
    t = _track()
    t.add_features(0, _rows(0, 3), cap=64)
    t.lose_drafter()
    assert t.take_features()[0] is None and t.feature_rows == 0
