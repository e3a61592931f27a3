"""Rejection sampler edge cases (torch reference)."""

import pytest
import torch

from specsplit.sampling.rejection import RejectionSampler
from specsplit.sampling.rng import SeqRandom, draw_step_uniforms
from specsplit.sampling.sample import sample_from_probs
from tests.helpers.rejection import sample_full

SAMPLER = RejectionSampler(backend="torch")


# ----------------------------------------------------------------------------------- greedy


def test_greedy_all_accepted_gives_k_plus_one():
    target = torch.tensor([[4, 5, 6, 7]])
    n, out = SAMPLER.greedy(torch.tensor([[4, 5, 6]]), torch.tensor([3]), target)
    assert n.tolist() == [3] and out.tolist() == [[4, 5, 6, 7]]


def test_greedy_all_rejected_gives_one():
    n, out = SAMPLER.greedy(
        torch.tensor([[1, 5, 6]]), torch.tensor([3]), torch.tensor([[4, 5, 6, 7]])
    )
    assert n.tolist() == [0] and out.tolist() == [[4, -1, -1, -1]]


def test_greedy_k_zero_and_num_draft_zero():
    n, out = SAMPLER.greedy(
        torch.zeros(2, 0, dtype=torch.long), torch.tensor([0, 0]), torch.tensor([[3], [9]])
    )
    assert n.tolist() == [0, 0] and out.tolist() == [[3], [9]]
    n, out = SAMPLER.greedy(torch.tensor([[3, 3]]), torch.tensor([0]), torch.tensor([[3, 3, 3]]))
    assert n.tolist() == [0] and out.tolist() == [[3, -1, -1]]


def test_greedy_mixed_num_draft():
    draft = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 9, 3], [1, 2, 3]])
    target = torch.tensor([[1, 2, 3, 4], [1, 2, 8, 8], [1, 2, 3, 4], [1, 2, 3, 4]])
    n, out = SAMPLER.greedy(draft, torch.tensor([3, 3, 3, 1]), target)
    assert n.tolist() == [3, 2, 1, 1]
    assert out.tolist() == [[1, 2, 3, 4], [1, 2, 8, -1], [1, 2, -1, -1], [1, 2, -1, -1]]
    assert ((out >= 0).sum(-1) == n + 1).all()


# ----------------------------------------------------------------------------------- random


def _random_case(batch, k, vocab, seed, q_equals_p=False):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(batch, k + 1, vocab, generator=g) * 2, -1)  # [B, K+1, V]
    q = (
        p[:, :k].clone()
        if q_equals_p
        else torch.softmax(torch.randn(batch, k, vocab, generator=g) * 2, -1)
    )
    u_draft = torch.rand(batch * k, dtype=torch.float64, generator=g)
    draft = sample_from_probs(q.reshape(-1, vocab), u_draft).reshape(batch, k)  # [B, K]
    u_accept = torch.rand(batch, k, dtype=torch.float64, generator=g)
    u_final = torch.rand(batch, dtype=torch.float64, generator=g)
    return draft, q, p, u_accept, u_final


def test_random_all_accepted_bonus_from_p():
    vocab, k = 6, 3
    p = torch.full((1, k + 1, vocab), 1.0 / vocab)
    q = torch.full((1, k, vocab), 1.0 / vocab)
    draft = torch.tensor([[0, 1, 2]])
    n, out = sample_full(SAMPLER,
        draft,
        q,
        torch.tensor([k]),
        p,
        torch.zeros(1, k, dtype=torch.float64),
        torch.tensor([0.99], dtype=torch.float64),
    )
    assert n.tolist() == [3] and out.tolist() == [[0, 1, 2, vocab - 1]]


def test_random_all_rejected_exactly_one():
    vocab, k = 5, 4
    p = torch.zeros(2, k + 1, vocab)
    p[..., 4] = 1.0
    q = torch.zeros(2, k, vocab)
    q[..., 0] = 1.0
    draft = torch.zeros(2, k, dtype=torch.long)
    n, out = sample_full(SAMPLER,
        draft,
        q,
        torch.tensor([k, 2]),
        p,
        torch.rand(2, k, dtype=torch.float64),
        torch.rand(2, dtype=torch.float64),
    )
    assert n.tolist() == [0, 0]
    assert out.tolist() == [[4, -1, -1, -1, -1]] * 2


def test_random_draft_equals_target_accepts_everything():
    draft, q, p, u_a, u_f = _random_case(16, 5, 12, seed=0, q_equals_p=True)
    n, out = sample_full(SAMPLER, draft, q, torch.full((16,), 5), p, u_a, u_f)
    assert (n == 5).all() and torch.equal(out[:, :5], draft)


def test_random_k_zero_is_plain_sampling():
    p = torch.softmax(torch.randn(3, 1, 7), -1)
    u = torch.rand(3, dtype=torch.float64)
    n, out = sample_full(SAMPLER,
        torch.zeros(3, 0, dtype=torch.long),
        torch.zeros(3, 0, 7),
        torch.zeros(3, dtype=torch.long),
        p,
        torch.zeros(3, 0, dtype=torch.float64),
        u,
    )
    assert n.tolist() == [0, 0, 0]
    assert torch.equal(out[:, 0], sample_from_probs(p[:, 0], u))


@pytest.mark.parametrize("seed", range(4))
def test_random_ids_in_range_and_lengths(seed):
    batch, k, vocab = 31, 6, 9
    draft, q, p, u_a, u_f = _random_case(batch, k, vocab, seed)
    num_draft = torch.randint(0, k + 1, (batch,), generator=torch.Generator().manual_seed(seed))
    n, out = sample_full(SAMPLER, draft, q, num_draft, p, u_a, u_f)
    assert (n <= num_draft).all() and (n >= 0).all()
    valid = out >= 0
    assert (valid.sum(-1) == n + 1).all()
    assert (out[valid] < vocab).all()
    pos = torch.arange(k + 1)[None]
    assert torch.equal(valid, pos <= n[:, None])  # valid ids form a prefix
    assert torch.equal(
        torch.where(pos < n[:, None], out, 0)[:, :k], torch.where(pos[:, :k] < n[:, None], draft, 0)
    )


def test_two_stage_equals_sample_full():
    batch, k, vocab = 12, 4, 11
    draft, q, p, u_a, u_f = _random_case(batch, k, vocab, seed=5)
    num_draft = torch.tensor([4, 3, 0, 1, 4, 4, 2, 2, 4, 0, 3, 1])
    n_full, out_full = sample_full(SAMPLER, draft, q, num_draft, p, u_a, u_f)
    q_x = q.gather(2, draft[:, :, None])[:, :, 0]
    n = SAMPLER.accept(draft, q_x, num_draft, p, u_a)
    assert torch.equal(n, n_full)
    rows = [q[b, n[b]] if n[b] < num_draft[b] else None for b in range(batch)]
    final = SAMPLER.finish(p[torch.arange(batch), n], rows, u_f)
    assert torch.equal(final, out_full[torch.arange(batch), n])


def test_out_of_range_draft_ids_rejected():
    p = torch.softmax(torch.randn(2, 3, 5), -1)
    n = SAMPLER.accept(
        torch.tensor([[-1, 0], [7, 0]]),
        torch.full((2, 2), 0.1),
        torch.tensor([2, 2]),
        p,
        torch.zeros(2, 2, dtype=torch.float64),
    )
    assert n.tolist() == [0, 0]


def test_residual_zero_falls_back_to_p():
    # q >= p everywhere (q is not a distribution here): residual is all zero, so sample from p
    p = torch.tensor([[0.0, 1.0, 0.0]])
    ids = SAMPLER.finish(
        p, torch.tensor([[1.0, 1.0, 1.0]]), torch.tensor([0.3], dtype=torch.float64)
    )
    assert ids.tolist() == [1]


def test_batched_equals_one_at_a_time_and_seeded():
    batch, k, vocab = 9, 5, 13
    draft, q, p, _, _ = _random_case(batch, k, vocab, seed=11)
    num_draft = torch.tensor([5, 0, 3, 5, 1, 2, 5, 4, 5])
    seeds = list(range(100, 100 + batch))

    def run(indices):
        rngs = [SeqRandom(seeds[i]) for i in indices]
        u_a, u_f = draw_step_uniforms(rngs, num_draft[indices].tolist(), k_max=k)
        return sample_full(SAMPLER,
            draft[indices], q[indices], num_draft[indices], p[indices], u_a, u_f
        )

    n_all, out_all = run(list(range(batch)))
    for b in range(batch):
        n_b, out_b = run([b])
        assert torch.equal(n_b[0], n_all[b]) and torch.equal(out_b[0], out_all[b])
    # same seeds, another batch composition and order -> same outputs per sequence
    order = [8, 2, 5]
    n_sub, out_sub = run(order)
    assert torch.equal(n_sub, n_all[order]) and torch.equal(out_sub, out_all[order])
    n_again, out_again = run(list(range(batch)))
    assert torch.equal(n_again, n_all) and torch.equal(out_again, out_all)


def test_one_hot_rows_behave_like_greedy():
    # temperature 0 turns p and q into one-hot rows; the random path then agrees with greedy
    g = torch.Generator().manual_seed(3)
    batch, k, vocab = 20, 4, 6
    target_argmax = torch.randint(0, 3, (batch, k + 1), generator=g)
    draft = torch.randint(0, 3, (batch, k), generator=g)
    p = torch.nn.functional.one_hot(target_argmax, vocab).float()
    q = torch.nn.functional.one_hot(draft, vocab).float()
    nd = torch.randint(0, k + 1, (batch,), generator=g)
    n_r, out_r = sample_full(SAMPLER,
        draft,
        q,
        nd,
        p,
        torch.rand(batch, k, dtype=torch.float64, generator=g),
        torch.rand(batch, dtype=torch.float64, generator=g),
    )
    n_g, out_g = SAMPLER.greedy(draft, nd, target_argmax)
    assert torch.equal(n_r, n_g) and torch.equal(out_r, out_g)
