"""The tie-certifying greedy comparison: exact passes, a certified near-tie passes and stops the
comparison, anything else fails (no tolerance for a real difference)."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.greedy import TIE_BOUND, assert_greedy_equal_or_tie


def _logits(rows: dict[int, dict[int, float]], vocab: int = 8):
    """next_logits for a fake model: after a context of length n, the row rows[n] (zeros elsewhere)."""
    seen = []

    def fn(context):
        seen.append(list(context))
        row = torch.zeros(vocab)
        for tok, val in rows.get(len(context), {}).items():
            row[tok] = val
        return row

    fn.seen = seen
    return fn


def test_exact_needs_no_logits():
    fn = _logits({})
    cmp = assert_greedy_equal_or_tie([1, 2, 3], fn, [1, 2, 3], prompt=[7])
    assert cmp.equal and fn.seen == []


def test_certified_tie_stops_the_comparison():
    fn = _logits({3: {4: 5.0, 6: 5.0 - TIE_BOUND / 2}})  # prompt (1 token) + 2 common tokens
    cmp = assert_greedy_equal_or_tie([1, 2, 4, 0, 0], fn, [1, 2, 6, 5, 5], prompt=[9])
    assert not cmp.equal and cmp.tie_at == 2 and cmp.gap == pytest.approx(TIE_BOUND / 2, abs=1e-6)
    assert fn.seen == [[9, 1, 2]]  # the reference's context at the difference


def test_real_difference_fails():
    fn = _logits({1: {4: 5.0, 6: 4.9}})
    with pytest.raises(AssertionError, match="not a tie"):
        assert_greedy_equal_or_tie([4], fn, [6], prompt=[9])


def test_two_close_tokens_below_the_top_are_not_a_tie():
    fn = _logits({1: {3: 9.0, 4: 5.0, 6: 5.0}})  # 4 and 6 tie with each other, but neither is the argmax
    with pytest.raises(AssertionError, match="not a tie"):
        assert_greedy_equal_or_tie([4], fn, [6], prompt=[9])


def test_length_difference_fails():
    with pytest.raises(AssertionError, match="equal up to the shorter"):
        assert_greedy_equal_or_tie([1, 2, 3], _logits({}), [1, 2])
