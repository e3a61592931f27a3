"""sample_from_probs: exact integer inverse CDF."""

import torch

from specsplit.sampling.sample import WEIGHT_SCALE, integer_weights, sample_from_probs


def test_inverse_cdf_boundaries():
    probs = torch.tensor([[0.25, 0.25, 0.5]])
    # weights 2**42, 2**42, 2**43; total 2**44; token = first index with cdf > floor(u * total)
    assert sample_from_probs(probs, torch.tensor([0.0], dtype=torch.float64)).item() == 0
    assert sample_from_probs(probs, torch.tensor([0.25 - 2**-50], dtype=torch.float64)).item() == 0
    assert sample_from_probs(probs, torch.tensor([0.25], dtype=torch.float64)).item() == 1
    assert sample_from_probs(probs, torch.tensor([0.5], dtype=torch.float64)).item() == 2
    assert sample_from_probs(probs, torch.tensor([1 - 2**-53], dtype=torch.float64)).item() == 2


def test_zero_mass_entries_never_sampled_and_fallback():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5], [0.0, 0.0, 0.0, 0.0], [0.0, 1e-20, 3e-20, 0.0]])
    u = torch.rand(3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    ids = sample_from_probs(probs, u)
    assert ids[0].item() in (1, 3)
    assert ids[1].item() == 0  # all zero: argmax (first index)
    assert ids[2].item() == 2  # every entry below 2**-44: argmax
    many = sample_from_probs(probs[:1].expand(10000, 4), torch.rand(10000, dtype=torch.float64))
    assert set(many.unique().tolist()) <= {1, 3}


def test_weights_exact_and_truncation_bound():
    probs = torch.softmax(torch.randn(8, 1000), -1)
    w = integer_weights(probs)
    assert torch.equal(w.double(), torch.floor(probs.double() * WEIGHT_SCALE))
    lost = probs.double().sum(-1) - w.sum(-1).double() / WEIGHT_SCALE
    assert (lost >= 0).all() and (lost < 1000 * 2**-44 + 1e-6).all()


def test_matches_distribution():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    n = 200_000
    ids = sample_from_probs(
        probs.expand(n, 4),
        torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(1)),
    )
    freq = torch.bincount(ids, minlength=4).double() / n
    assert (freq - probs.double()).abs().sum() / 2 < 0.01
