"""Random rejection kernels (accept test, recovered / bonus sample) == torch references."""

import pytest
import torch

from specsplit.kernels.reference import random_accept_ref, random_finish_ref
from specsplit.sampling.rejection import RejectionSampler
from specsplit.sampling.sample import sample_from_probs
from tests.helpers.rejection import sample_full


@pytest.fixture(scope="module")
def rr(load_kernel):
    return load_kernel("rejection_random")


def _probs(shape, vocab, g, scale=3.0, sparsity=0.0):
    logits = torch.randn(*shape, vocab, generator=g) * scale
    if sparsity:
        logits = logits.masked_fill(
            torch.rand(*shape, vocab, generator=g) < sparsity, float("-inf")
        )
    return torch.softmax(logits, -1)


def _accept_case(batch, k, vocab, seed, device, q_like_p=0.5):
    g = torch.Generator().manual_seed(seed)
    p = _probs((batch, k + 1), vocab, g)  # [B, K+1, V]
    q = torch.where(
        torch.rand(batch, k, 1, generator=g) < q_like_p, p[:, :k], _probs((batch, k), vocab, g)
    )
    draft = sample_from_probs(
        q.reshape(-1, vocab), torch.rand(batch * k, dtype=torch.float64, generator=g)
    ).reshape(batch, k)
    q_x = q.gather(2, draft[:, :, None])[:, :, 0]
    num_draft = torch.randint(0, k + 1, (batch,), generator=g)
    u = torch.rand(batch, k, dtype=torch.float64, generator=g)
    return [t.to(device) for t in (draft, q_x, num_draft, p, u)]


@pytest.mark.parametrize(
    "batch,k,vocab",
    [(1, 1, 10), (5, 3, 10), (31, 8, 10), (2, 5, 49152), (2, 4, 151936), (13, 7, 37)],
)
def test_accept_matches_reference(rr, device, batch, k, vocab):
    for seed in range(3):
        args = _accept_case(batch, k, vocab, seed, device)
        expected = random_accept_ref(*args)
        assert torch.equal(rr.random_accept_triton(*args), expected)


def test_accept_all_and_none_and_bad_ids(rr, device):
    draft, q_x, _, p, u = _accept_case(6, 4, 10, 0, device)
    full = torch.full((6,), 4, device=device)
    # u = 0 with q_x <= p ... accept all: use q equal to p(x)
    p_x = p[:, :4].gather(2, draft[:, :, None])[:, :, 0]
    n = rr.random_accept_triton(draft, p_x, full, p, torch.zeros_like(u))
    assert (
        torch.equal(n, random_accept_ref(draft, p_x, full, p, torch.zeros_like(u)))
        and (n == 4).all()
    )
    n = rr.random_accept_triton(draft, torch.ones_like(q_x), full, p, torch.full_like(u, 0.999999))
    assert (n == 0).all()
    bad = draft.clone()
    bad[:, 0] = torch.tensor([-1, 10, 99, -7, 10, 11], device=device)
    n = rr.random_accept_triton(bad, q_x, full, p, torch.zeros_like(u))
    assert (
        torch.equal(n, random_accept_ref(bad, q_x, full, p, torch.zeros_like(u))) and (n == 0).all()
    )
    k0 = torch.zeros(6, 0, dtype=torch.long, device=device)
    assert (rr.random_accept_triton(k0, q_x[:, :0], full * 0, p[:, :1], u[:, :0]) == 0).all()


@pytest.mark.parametrize(
    "batch,vocab,block_v",
    [
        (1, 10, None),
        (7, 10, 4),
        (9, 50, 16),
        (31, 30, None),
        (2, 49152, None),
        (2, 49152, 2048),
        (1, 151936, None),
    ],
)
def test_finish_matches_reference(rr, device, batch, vocab, block_v):
    g = torch.Generator().manual_seed(vocab + batch)
    p = _probs((batch,), vocab, g, sparsity=0.3)
    q = _probs((batch,), vocab, g, sparsity=0.3)
    q[0] = 0  # row 0: bonus token from p
    if batch > 2:
        q[1] = p[1]  # row 1: residual all zero -> falls back to p
    for seed in range(3):
        u = torch.rand(batch, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        args = [t.to(device) for t in (p, q, u)]
        expected = random_finish_ref(*args)
        got = rr.random_finish_triton(*args, block_v=block_v)
        assert torch.equal(got, expected)
        assert ((got >= 0) & (got < vocab)).all()


def test_finish_boundaries_and_zero_mass(rr, device):
    p = torch.tensor(
        [[0.25, 0.25, 0.5, 0.0]] * 5 + [[0.0, 0.0, 0.0, 0.0], [0.0, 1e-20, 3e-20, 2e-20]],
        device=device,
    )
    q = torch.zeros_like(p)
    u = torch.tensor(
        [0.0, 0.25 - 2**-50, 0.25, 0.5, 1 - 2**-53, 0.5, 0.5], dtype=torch.float64, device=device
    )
    got = rr.random_finish_triton(p, q, u, block_v=2)
    assert got.tolist() == [0, 0, 1, 2, 2, 0, 2]
    assert torch.equal(got, random_finish_ref(p, q, u))


def test_finish_nan_and_garbage_rows_stay_in_range(rr, device):
    p = torch.tensor(
        [[float("nan"), 0.5, 0.5], [2.0, -1.0, float("inf")], [-1.0, -2.0, -3.0]], device=device
    )
    q = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]], device=device)
    u = torch.tensor([0.7, 0.7, 0.7], dtype=torch.float64, device=device)
    got = rr.random_finish_triton(p, q, u)
    assert torch.equal(got, random_finish_ref(p, q, u))
    assert ((got >= 0) & (got < 3)).all()


@pytest.mark.parametrize("batch,k,vocab", [(17, 5, 10), (2, 3, 49152)])
def test_sampler_through_dispatch_equals_torch(force_triton, device, batch, k, vocab):
    g = torch.Generator().manual_seed(k)
    p = _probs((batch, k + 1), vocab, g)
    q = _probs((batch, k), vocab, g)
    q[: batch // 2] = p[: batch // 2, :k]  # half the rows accept everything
    draft = sample_from_probs(
        q.reshape(-1, vocab), torch.rand(batch * k, dtype=torch.float64, generator=g)
    ).reshape(batch, k)
    num_draft = torch.randint(0, k + 1, (batch,), generator=g)
    u_a = torch.rand(batch, k, dtype=torch.float64, generator=g)
    u_f = torch.rand(batch, dtype=torch.float64, generator=g)
    args = [t.to(device) for t in (draft, q, num_draft, p, u_a, u_f)]
    n_t, out_t = sample_full(RejectionSampler(), *args)
    n_r, out_r = sample_full(RejectionSampler(backend="torch"), *args)
    assert torch.equal(n_t, n_r) and torch.equal(out_t, out_r)
    assert (n_t[: batch // 2] == num_draft[: batch // 2].to(device)).all()
