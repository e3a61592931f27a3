"""SeqRandom: uniforms keyed by (seed, side, position, purpose), independent of the batch."""

import torch

from specsplit.sampling.rng import SeqRandom, derive_seed, draw_step_uniforms


def test_seeded_reproducible_and_streams_independent():
    a, b = SeqRandom(7), SeqRandom(7)
    assert torch.equal(a.uniforms(0, 5, "accept"), b.uniforms(0, 5, "accept"))
    assert a.uniforms(0, 3, "accept").dtype == torch.float64
    assert not torch.equal(SeqRandom(7, "drafter").uniforms(0, 4, "x"), SeqRandom(7, "verifier").uniforms(0, 4, "x"))
    assert not torch.equal(SeqRandom(7).uniforms(0, 4, "x"), SeqRandom(8).uniforms(0, 4, "x"))
    assert not torch.equal(SeqRandom(7).uniforms(0, 4, "accept"), SeqRandom(7).uniforms(0, 4, "final"))
    assert derive_seed(2**64 - 1, "verify") < 2**63


def test_keyed_by_position_not_by_draw_order():
    """What made seeded output change with load: the uniform at a position must not depend on how
    many were drawn before (K, speculation on/off, steps)."""
    a, b = SeqRandom(11), SeqRandom(11)
    a.uniforms(0, 40, "accept")  # many earlier draws on one of them
    assert a.uniform(57, "final") == b.uniform(57, "final")
    assert torch.equal(a.uniforms(50, 3, "accept"), b.uniforms(50, 3, "accept")[:3])
    assert torch.equal(a.uniforms(50, 3, "accept")[1:], b.uniforms(51, 2, "accept"))


def test_uniform_range_and_spread():
    u = SeqRandom(5).uniforms(0, 20000, "draft")
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.01
    assert len(set(u.tolist())) == 20000


def test_unseeded_differs():
    assert not torch.equal(SeqRandom(None).uniforms(0, 4, "x"), SeqRandom(None).uniforms(0, 4, "x"))


def test_step_uniforms_independent_of_batch():
    alone = draw_step_uniforms([SeqRandom(3)], [2], k_max=2, starts=[10])
    batched = draw_step_uniforms([SeqRandom(1), SeqRandom(3), SeqRandom(5)], [4, 2, 0], k_max=4, starts=[0, 10, 7])
    assert torch.equal(batched[0][1, :2], alone[0][0])
    assert torch.equal(batched[1][1], alone[1][0])
    assert (batched[0][2] == 0).all() and (batched[0][1, 2:] == 0).all()
