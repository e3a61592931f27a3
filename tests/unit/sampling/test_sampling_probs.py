"""logits_to_probs: temperature, top-k, top-p semantics and greedy rows."""

import pytest
import torch

from specsplit.sampling import SamplingParams, logits_to_probs, sampling_tensors
from specsplit.sampling.probs import greedy_ids


def _probs(logits, temperature, top_k=0, top_p=1.0, min_p=0.0):
    n = logits.shape[0]
    return logits_to_probs(
        logits,
        torch.full((n,), float(temperature)),
        torch.full((n,), int(top_k)),
        torch.full((n,), float(top_p)),
        torch.full((n,), float(min_p)),
    )


def test_plain_softmax_with_temperature():
    logits = torch.randn(4, 17, generator=torch.Generator().manual_seed(0))
    probs = _probs(logits, 0.7)
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs, torch.softmax(logits / 0.7, dim=-1))


def test_hand_computed_top_k_and_top_p():
    # softmax(log p) = p, so the numbers below are exact probabilities.
    p = torch.tensor([[0.1, 0.4, 0.2, 0.3]])
    logits = p.log()
    # top-k 2 keeps 0.4 and 0.3
    torch.testing.assert_close(
        _probs(logits, 1.0, top_k=2), torch.tensor([[0.0, 4 / 7, 0.0, 3 / 7]])
    )
    # top-p 0.6: mass above 0.4 is 0 (<0.6 keep), above 0.3 is 0.4 (keep), above 0.2 is 0.7 (drop)
    torch.testing.assert_close(
        _probs(logits, 1.0, top_p=0.6), torch.tensor([[0.0, 4 / 7, 0.0, 3 / 7]])
    )
    # top-p 0.75 also keeps 0.2
    torch.testing.assert_close(
        _probs(logits, 1.0, top_p=0.75), torch.tensor([[0.0, 4 / 9, 2 / 9, 3 / 9]])
    )
    # tiny top-p keeps the argmax only
    torch.testing.assert_close(
        _probs(logits, 1.0, top_p=1e-6), torch.tensor([[0.0, 1.0, 0.0, 0.0]])
    )
    # top-k 3 then top-p 0.5 on the renormalised {0.4, 0.3, 0.2}/0.9: 0.444 < 0.5 so keep 0.3 too
    torch.testing.assert_close(
        _probs(logits, 1.0, top_k=3, top_p=0.5), torch.tensor([[0.0, 4 / 7, 0.0, 3 / 7]])
    )


def test_top_k_ties_are_all_kept():
    logits = torch.tensor([[1.0, 3.0, 2.0, 2.0, 0.0]])
    probs = _probs(logits, 1.0, top_k=2)
    assert (probs[0, [1, 2, 3]] > 0).all() and probs[0, 0] == 0 and probs[0, 4] == 0


def test_greedy_rows_are_one_hot_first_max():
    logits = torch.tensor([[0.0, 5.0, 5.0, 1.0], [2.0, 1.0, 0.0, -1.0]])
    probs = logits_to_probs(
        logits, torch.tensor([0.0, 1.0]), torch.tensor([0, 0]), torch.tensor([1.0, 1.0])
    )
    assert torch.equal(probs[0], torch.tensor([0.0, 1.0, 0.0, 0.0]))
    torch.testing.assert_close(probs[1], torch.softmax(logits[1], -1))


def test_mixed_rows_and_sampling_tensors():
    params = [
        SamplingParams(),
        SamplingParams(temperature=0.8, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.9, min_p=0.05),
    ]
    t, k, p, m = sampling_tensors(params, rows_per_seq=[1, 2, 3])
    assert t.tolist() == pytest.approx([0.0, 0.8, 0.8, 1.3, 1.3, 1.3])
    assert k.tolist() == [0, 5, 5, 0, 0, 0]
    assert m.tolist() == pytest.approx([0.0, 0.0, 0.0, 0.05, 0.05, 0.05])
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(1))
    probs = logits_to_probs(logits, t, k, p, m)
    torch.testing.assert_close(probs.sum(-1), torch.ones(6))
    assert (probs[0] == 1).sum() == 1
    assert ((probs[1:3] > 0).sum(-1) == 5).all()


@pytest.mark.parametrize(
    "temperature,top_k,top_p,min_p", [(1.0, 0, 0.9, 0.0), (0.6, 7, 1.0, 0.0), (1.5, 12, 0.8, 0.0), (0.9, 3, 0.3, 0.0),
                                      (1.0, 0, 1.0, 0.1), (0.7, 20, 0.95, 0.05), (1.8, 0, 0.9, 0.3), (1.0, 0, 1.0, 1.0)]
)
def test_matches_transformers_warpers(temperature, top_k, top_p, min_p):
    lp = pytest.importorskip("transformers.generation.logits_process")
    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(2)) * 2
    scores = lp.TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        scores = lp.TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = lp.TopPLogitsWarper(top_p)(None, scores)
    if min_p > 0.0:
        scores = lp.MinPLogitsWarper(min_p)(None, scores)
    expected = torch.softmax(scores, dim=-1)
    got = _probs(logits, temperature, top_k, top_p, min_p)
    torch.testing.assert_close(got, expected)
    if min_p > 0.0:  # the case filters something
        assert ((got > 0).sum(-1) < (_probs(logits, temperature, top_k, top_p) > 0).sum(-1)).any()


def test_minus_inf_logits_and_large_top_k():
    logits = torch.tensor([[0.0, float("-inf"), 1.0, float("-inf")]])
    probs = _probs(logits, 1.0, top_k=100, top_p=0.99)
    assert probs[0, 1] == 0 and probs[0, 3] == 0
    torch.testing.assert_close(probs.sum(), torch.tensor(1.0))


def test_greedy_ids_are_torch_argmax_on_ties_nans_and_strides():
    """greedy_ids (max's indices, the faster call) gives torch.argmax's ids: the first maximum on
    ties, a NaN as the maximum, all -inf rows, strided rows, SmolLM2's vocabulary width and odd ones."""
    g = torch.Generator().manual_seed(25)
    for n in (1, 17, 63, 64, 65, 1000, 49152):
        for kind in ("ties", "normal", "nan", "-inf"):
            rows = torch.randint(-2, 2, (5, n), generator=g).float() if kind == "ties" else torch.randn(5, n, generator=g)
            if kind == "nan":
                rows[torch.arange(5), torch.randint(0, n, (5,), generator=g)] = float("nan")
            if kind == "-inf":
                rows[1:3] = float("-inf")
            for x in (rows, rows[:, ::2], rows[0]):
                if x.shape[-1]:
                    assert torch.equal(greedy_ids(x), x.argmax(dim=-1)), (n, kind, x.shape)
