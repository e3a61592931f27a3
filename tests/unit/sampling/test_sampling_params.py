"""SamplingParams.validate: the one place the sampling rules live."""
import math

import pytest

from specsplit.sampling.params import MIN_TEMPERATURE, SamplingParams


@pytest.mark.parametrize("t", [0.0, MIN_TEMPERATURE, 0.7, 1.0, 2.5, 1e4])
def test_valid_temperatures(t):
    SamplingParams(temperature=t).validate()


@pytest.mark.parametrize("t", [1e-40, 5e-3, -0.0001, -1.0, math.nan, math.inf, -math.inf, 1e5])
def test_refused_temperatures(t):
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=t).validate()


@pytest.mark.parametrize("kw, field", [(dict(top_p=math.nan), "top_p"), (dict(top_p=math.inf), "top_p"),
                                       (dict(top_p=0.0), "top_p"), (dict(top_k=-1), "top_k"), (dict(seed=-1), "seed"),
                                       (dict(seed=2**64), "seed")])
def test_refused_fields(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(temperature=1.0, **kw).validate()


def test_smallest_temperature_gives_finite_probabilities():
    """The bound is where float32 sampling still works: logits of a real model's range at 1e-2."""
    import torch

    from specsplit.sampling import logits_to_probs

    logits = torch.tensor([[40.0, 39.9, -30.0, 0.0]])
    probs = logits_to_probs(logits, torch.tensor([MIN_TEMPERATURE]), torch.tensor([0]), torch.tensor([1.0]))
    assert torch.isfinite(probs).all() and abs(float(probs.sum()) - 1.0) < 1e-5
