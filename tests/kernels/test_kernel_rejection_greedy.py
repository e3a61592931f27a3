"""Greedy rejection kernel == torch reference."""

import pytest
import torch

from specsplit.kernels.reference import greedy_rejection_ref
from specsplit.sampling.rejection import RejectionSampler


@pytest.fixture(scope="module")
def greedy_triton(load_kernel):
    return load_kernel("rejection_greedy").greedy_rejection_triton


def _case(batch, k, vocab, seed, device, match_rate=0.7):
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(0, vocab, (batch, k + 1), generator=g)
    draft = torch.where(
        torch.rand(batch, k, generator=g) < match_rate,
        target[:, :k],
        torch.randint(0, vocab, (batch, k), generator=g),
    )
    num_draft = torch.randint(0, k + 1, (batch,), generator=g)
    return draft.to(device), num_draft.to(device), target.to(device)


def _assert_equal(triton_fn, draft, num_draft, target):
    n_ref, out_ref = greedy_rejection_ref(draft, num_draft, target)
    n_tri, out_tri = triton_fn(draft, num_draft, target)
    assert torch.equal(n_tri, n_ref) and torch.equal(out_tri, out_ref)
    return n_tri, out_tri


@pytest.mark.parametrize(
    "batch,k,vocab",
    [(1, 1, 10), (3, 2, 10), (7, 5, 49152), (16, 8, 151936), (31, 7, 10), (29, 3, 151936)],
)
def test_matches_reference_mixed_lengths(greedy_triton, device, batch, k, vocab):
    for seed in range(3):
        _, out = _assert_equal(greedy_triton, *_case(batch, k, vocab, seed, device))
        assert ((out >= -1) & (out < vocab)).all()


def test_all_accepted_and_all_rejected(greedy_triton, device):
    target = torch.arange(6 * 5, device=device).reshape(6, 5) % 10
    draft = target[:, :4].clone()
    n, out = _assert_equal(greedy_triton, draft, torch.full((6,), 4, device=device), target)
    assert (n == 4).all() and torch.equal(out, target)
    n, out = _assert_equal(
        greedy_triton, (draft + 1) % 10, torch.full((6,), 4, device=device), target
    )
    assert (n == 0).all() and ((out >= 0).sum(-1) == 1).all()


def test_k_zero_and_num_draft_zero(greedy_triton, device):
    target = torch.tensor([[5], [7]], device=device)
    _assert_equal(
        greedy_triton,
        torch.zeros(2, 0, dtype=torch.long, device=device),
        torch.zeros(2, dtype=torch.long, device=device),
        target,
    )
    draft, _, target = _case(4, 3, 10, 0, device, match_rate=1.0)
    n, _ = _assert_equal(
        greedy_triton, draft, torch.zeros(4, dtype=torch.long, device=device), target
    )
    assert (n == 0).all()


def test_non_contiguous_inputs(greedy_triton, device):
    draft, num_draft, target = _case(9, 4, 10, 1, device, match_rate=0.9)
    wide = torch.cat([target, target], 1)[:, :5]  # row stride 10
    _assert_equal(greedy_triton, draft, num_draft, wide)


@pytest.mark.parametrize("batch,k,vocab", [(1, 1, 10), (3, 2, 10), (7, 5, 49152), (31, 7, 10)])
def test_the_host_rule_accepts_what_the_reference_accepts(batch, k, vocab):
    """RejectionSampler.greedy_host (the verifier's host-list rule) == greedy_rejection_ref: the same counts, and
    the emitted tokens are the reference's unpadded ones. Each sequence has its own draft count."""
    for seed in range(5):
        draft, num_draft, target = _case(batch, k, vocab, seed, "cpu", match_rate=0.8)
        n_ref, out_ref = greedy_rejection_ref(draft, num_draft, target)
        drafts = [draft[b, : int(num_draft[b])].tolist() for b in range(batch)]
        targets = [target[b, : int(num_draft[b]) + 1].tolist() for b in range(batch)]
        accepted = RejectionSampler.greedy_host(drafts, targets)
        assert accepted == n_ref.tolist()
        for b in range(batch):
            assert targets[b][: accepted[b] + 1] == [t for t in out_ref[b].tolist() if t != -1]


def test_the_host_rule_stops_at_the_first_mismatch_and_counts_all_drafts_when_none_differ():
    assert RejectionSampler.greedy_host([[4, 5, 6], [4, 9, 6], [], [1]], [[4, 5, 6, 7], [4, 5, 6, 7], [3], [2, 8]]) == [3, 1, 0, 0]
