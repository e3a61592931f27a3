"""Seeded sampling through the services: the same tokens split and colocated, again when
repeated, and -- seeded requests are coupled (specsplit.sampling.coupled) -- with speculation on,
off, at another K, or under load. (The rejection path's q(x) and q rows over the wire are covered
by tests/services/test_services_wire.py and test_services_abandon.py.)"""
from __future__ import annotations

import pytest

import threading

from specsplit.v1 import gateway_pb2
from tests.services.procs import generate, request

CASES = {
    "dense q rows": dict(temperature=0.9, top_p=1.0, top_k=0),
    "sparse q rows (top-k)": dict(temperature=0.7, top_p=1.0, top_k=12),
    "top-p": dict(temperature=1.5, top_p=0.9, top_k=0),
    "min-p": dict(temperature=1.5, top_p=1.0, top_k=0, min_p=0.2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_seeded_sampling_split_equals_colocated(split_stack, colocated_stack, prompts, case):
    kw = dict(CASES[case], max_tokens=32, ignore_eos=True)
    proposed = rejected = 0
    for i, ids in enumerate(prompts[20:23]):
        split = generate(split_stack.gateway, request(ids, seed=100 + i, **kw))
        again = generate(split_stack.gateway, request(ids, seed=100 + i, **kw))
        colo = generate(colocated_stack.gateway, request(ids, seed=100 + i, **kw))
        assert split["token_ids"] == again["token_ids"] == colo["token_ids"], (case, ids)
        assert split["usage"] == colo["usage"]
        proposed += split["usage"]["proposed_draft_tokens"]
        rejected += split["usage"]["proposed_draft_tokens"] - split["usage"]["accepted_draft_tokens"]
    assert proposed > 0
    if case not in ("top-p", "min-p"):  # peaked tiny models: a 0.9 nucleus is often one token, never rejected
        assert rejected > 0  # rejections happened


def test_unseeded_sampling_completes(split_stack, prompts):
    out = generate(split_stack.gateway, request(prompts[23], max_tokens=16, temperature=0.8, ignore_eos=True))
    assert len(out["token_ids"]) == 16 and out["finish_reason"] == "length"


def test_seeded_tokens_do_not_change_with_speculation_or_load(split_stack, prompts):
    """The issue's measurement: a seeded request alone, then with 3 other streams running, then
    with speculation off and at another K -- the same tokens every time."""
    ids = prompts[5]

    def seeded(**spec):
        return request(ids, max_tokens=24, temperature=0.8, seed=4242, ignore_eos=True,
                       speculation=gateway_pb2.Speculation(**spec) if spec else None)

    alone = generate(split_stack.gateway, seeded())["token_ids"]
    assert len(alone) == 24
    others = [threading.Thread(target=generate, args=(split_stack.gateway, request(prompts[i], max_tokens=40,
                                                                              temperature=1.0, ignore_eos=True)))
              for i in (6, 7, 8)]
    for t in others:
        t.start()
    loaded = generate(split_stack.gateway, seeded())["token_ids"]
    for t in others:
        t.join()
    assert loaded == alone
    assert generate(split_stack.gateway, seeded(disable=True))["token_ids"] == alone
    assert generate(split_stack.gateway, seeded(num_speculative_tokens=1))["token_ids"] == alone
    assert generate(split_stack.gateway, seeded(num_speculative_tokens=4))["token_ids"] == alone


def test_min_p_reaches_the_engines_and_keeps_the_seed_s_tokens(split_stack, prompts):
    """A seeded min-p request: the same tokens with speculation on and off (coupled sampling gives
    the target-only tokens of a seed), and not the tokens of the same seed without min-p."""
    ids = prompts[9]

    def seeded(min_p, **spec):
        return request(ids, max_tokens=32, temperature=1.5, seed=77, ignore_eos=True, min_p=min_p,
                       speculation=gateway_pb2.Speculation(**spec) if spec else None)

    on = generate(split_stack.gateway, seeded(0.2))
    assert on["usage"]["proposed_draft_tokens"] > 0
    assert generate(split_stack.gateway, seeded(0.2, disable=True))["token_ids"] == on["token_ids"]
    assert generate(split_stack.gateway, seeded(0.0))["token_ids"] != on["token_ids"]
