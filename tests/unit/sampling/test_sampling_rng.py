"""SeqRandom: per-sequence reproducible streams."""

import torch

from specsplit.sampling.rng import SeqRandom, derive_seed, draw_step_uniforms


def test_seeded_reproducible_and_streams_independent():
    a, b = SeqRandom(7), SeqRandom(7)
    assert torch.equal(a.uniforms(5), b.uniforms(5))
    assert a.uniforms(3).dtype == torch.float64
    assert not torch.equal(SeqRandom(7, "draft").uniforms(4), SeqRandom(7, "verify").uniforms(4))
    assert not torch.equal(SeqRandom(7).uniforms(4), SeqRandom(8).uniforms(4))
    assert derive_seed(2**64 - 1, "verify") < 2**63


def test_unseeded_differs():
    assert not torch.equal(SeqRandom(None).uniforms(4), SeqRandom(None).uniforms(4))


def test_step_uniforms_independent_of_batch():
    alone = draw_step_uniforms([SeqRandom(3)], [2], k_max=2)
    batched = draw_step_uniforms([SeqRandom(1), SeqRandom(3), SeqRandom(5)], [4, 2, 0], k_max=4)
    assert torch.equal(batched[0][1, :2], alone[0][0])
    assert torch.equal(batched[1][1], alone[1][0])
    assert (batched[0][2] == 0).all() and (batched[0][1, 2:] == 0).all()
