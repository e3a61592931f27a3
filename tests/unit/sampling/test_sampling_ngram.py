"""Prompt-lookup proposer."""

import time

import torch

from specsplit.sampling.ngram import ngram_branches, ngram_propose, ngram_q_rows


def test_finds_most_recent_longest_match():
    #        0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 1, 2, 3, 4, 1, 2]
    # suffix [1, 2] last occurred at 4..5, followed by 3, 4, 1, 2
    assert ngram_propose(tokens, k=3) == [3, 4, 1]
    assert ngram_propose(tokens, k=10) == [3, 4, 1, 2]


def test_longer_ngram_wins_over_more_recent_shorter():
    tokens = [5, 6, 7, 8, 0, 6, 1, 5, 6]
    # 2-gram [5, 6] matches at 0 (followed by 7); 1-gram [6] more recently at 5 (followed by 1)
    assert ngram_propose(tokens, k=2) == [7, 8]
    assert ngram_propose(tokens, k=2, n_max=1) == [1, 5]


def test_respects_k_and_no_match():
    assert ngram_propose([1, 2, 3, 4], k=3) == []
    assert ngram_propose([], k=3) == []
    assert ngram_propose([7], k=3) == []
    assert ngram_propose([1, 2, 1, 2], k=0) == []
    assert ngram_propose([1, 2, 1], k=1) == [2]
    assert ngram_propose([3, 3, 3, 3], k=5) == [
        3
    ]  # overlap: the match ending at index 2 is followed by one token


def test_n_min_excludes_short_matches():
    assert ngram_propose([1, 2, 3, 4, 1], k=2, n_min=2) == []
    assert ngram_propose([1, 2, 3, 4, 1], k=2, n_min=1) == [2, 3]


def test_fast_on_long_context():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 50, (4000,), generator=g).tolist()
    start = time.perf_counter()
    for _ in range(50):
        ngram_propose(tokens, k=5)
    assert time.perf_counter() - start < 2.0


def test_q_rows_one_hot():
    q = ngram_q_rows(torch.tensor([[2, 0]]), vocab_size=4)
    assert torch.equal(q, torch.tensor([[[0.0, 0, 1, 0], [1, 0, 0, 0]]]))


def _brute_propose(tokens, k, n_min, n_max):
    """The definition, spelled out: for n from n_max down, the most recent earlier occurrence of
    the last n tokens wins; the k tokens after it."""
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def test_propose_equals_the_definition_and_is_the_first_branch():
    import random

    rng = random.Random(5)
    for _ in range(2000):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(0, 30))]
        k, n_min, n_max = rng.randrange(0, 5), rng.randrange(1, 3), rng.randrange(1, 5)
        want = _brute_propose(tokens, k, n_min, n_max) if k > 0 and tokens else []
        assert ngram_propose(tokens, k, n_min, n_max) == want, (tokens, k, n_min, n_max)
        branches = ngram_branches(tokens, k, 3, n_min, n_max)
        assert (branches[0] if branches else []) == want
