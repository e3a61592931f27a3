"""specsplit/sampling/logprobs.py: log_softmax of the raw logits at each emitted token, the top n
most likely first, one log_softmax + topk over every sequence's stacked rows."""
from __future__ import annotations

import pytest
import torch

from specsplit.protocols import TokenLogprob
from specsplit.sampling.logprobs import MAX_LOGPROBS, seq_logprobs, token_logprobs


def _rows(r: int, v: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(r, v, generator=torch.Generator().manual_seed(seed)) * 3  # [R, V]


def test_values_are_log_softmax_and_top_is_sorted():
    rows = _rows(4)
    ids = [3, 0, 49, 7]
    out = token_logprobs(rows, ids, [5, 0, 1, 20])
    ref = torch.log_softmax(rows, dim=-1)
    for r, (t, lp) in enumerate(zip(ids, out)):
        assert lp.token_id == t and lp.logprob == pytest.approx(float(ref[r, t]), abs=1e-6)
        assert len(lp.top) == [5, 0, 1, 20][r]
        vals = [v for _, v in lp.top]
        assert vals == sorted(vals, reverse=True)
        want = ref[r].topk(len(lp.top)).indices.tolist() if lp.top else []
        assert [i for i, _ in lp.top] == want
        for i, v in lp.top:
            assert v == pytest.approx(float(ref[r, i]), abs=1e-6)


def test_rank_counts_the_tokens_at_least_as_likely():
    """vLLM's rank: 1 for the most likely, a tie counts against the token (rows with ties made on
    purpose), computed whatever n is."""
    rows = _rows(3, seed=4)
    rows[1, 10] = rows[1, 11] = rows[1].max() + 1.0  # a tie at the top
    rows[2, :] = 0.0  # every token tied
    ids = [int(rows[0].argsort(descending=True)[6]), 11, 3]
    out = token_logprobs(rows, ids, [0, 2, 0])
    for r, (t, lp) in enumerate(zip(ids, out)):
        assert lp.rank == sum(float(x) >= float(rows[r, t]) for x in rows[r])  # brute force, on the logits
    assert [lp.rank for lp in out] == [7, 2, rows.shape[1]]
    assert token_logprobs(rows[:1], [int(rows[0].argmax())], [0])[0].rank == 1


def test_ranks_cross_the_wire():
    from specsplit.rpc.wire import logprobs_from_pb, logprobs_to_pb

    lps = tuple(token_logprobs(_rows(3, seed=5), [1, 2, 3], [2, 0, 1]))
    assert logprobs_from_pb(logprobs_to_pb(lps)) == tuple(
        TokenLogprob(x.token_id, pytest.approx(x.logprob), tuple((i, pytest.approx(v)) for i, v in x.top), x.rank)
        for x in lps)
    assert all(x.rank >= 1 for x in lps)


def test_top_of_the_argmax_is_the_token_itself():
    rows = _rows(3, seed=1)
    ids = rows.argmax(-1).tolist()
    for lp in token_logprobs(rows, ids, [1, 1, 1]):
        assert lp.top[0] == (lp.token_id, pytest.approx(lp.logprob))


def test_raw_logits_not_the_sampling_transform():
    """Temperature / top-k / top-p are not applied: a token outside a top-k still has a finite
    log-probability, the model's own."""
    rows = _rows(1, seed=2)
    worst = int(rows[0].argmin())
    (lp,) = token_logprobs(rows, [worst], [0])
    assert lp.logprob == pytest.approx(float(torch.log_softmax(rows[0], -1)[worst]), abs=1e-6)
    assert lp.logprob > -float("inf")


def test_half_precision_logits_are_scored_in_fp32():
    rows = _rows(2, seed=3)
    a = token_logprobs(rows.to(torch.bfloat16), [1, 2], [2, 2])
    b = token_logprobs(rows.to(torch.bfloat16).float(), [1, 2], [2, 2])
    assert a == b


def test_per_sequence_batching_equals_one_by_one():
    rows = [_rows(3, seed=4), _rows(1, seed=5), _rows(0, seed=6), _rows(2, seed=7)]
    ids = [[1, 2, 3], [4], [], [5, 6]]
    n = [2, 0, 7, 20]
    batched = seq_logprobs(rows, ids, n)
    assert [len(x) for x in batched] == [3, 1, 0, 2]
    for r, i, k, got in zip(rows, ids, n, batched):
        assert got == tuple(token_logprobs(r, i, [k] * len(i)))
    assert all(isinstance(t, TokenLogprob) for x in batched for t in x)


def test_n_larger_than_the_vocabulary_is_capped():
    (lp,) = token_logprobs(_rows(1, v=4), [0], [MAX_LOGPROBS])
    assert len(lp.top) == 4


@pytest.mark.parametrize("rows, ids, n", [(_rows(2), [1], [1]), (_rows(2), [1, 2], [1]), (torch.zeros(3), [1, 2, 3], [0, 0, 0])])
def test_shape_mismatch_is_an_error(rows, ids, n):
    with pytest.raises(ValueError):
        token_logprobs(rows, ids, n)


def test_rows_and_tokens_must_agree_per_sequence():
    with pytest.raises(ValueError):
        seq_logprobs([_rows(2)], [[1]], [1])


def test_empty():
    assert token_logprobs(torch.zeros(0, 5), [], []) == []
    assert seq_logprobs([], [], []) == []
