"""Seeded sampling crosses the wire exactly: q(x) per draft and the q row at a rejection
(dense, or sparse under top-k) reach the verifier bit for bit, so a seeded request gives the
same tokens split and colocated, and again when repeated."""
from __future__ import annotations

import pytest

from tests.services.procs import generate, request

CASES = {
    "dense q rows": dict(temperature=0.9, top_p=1.0, top_k=0),
    "sparse q rows (top-k)": dict(temperature=0.7, top_p=1.0, top_k=12),
    "top-p": dict(temperature=1.5, top_p=0.9, top_k=0),
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
    if case != "top-p":  # peaked tiny models: a 0.9 nucleus is often one token, never rejected
        assert rejected > 0  # rejections happened: the q-row path ran


def test_unseeded_sampling_completes(split_stack, prompts):
    out = generate(split_stack.gateway, request(prompts[23], max_tokens=16, temperature=0.8, ignore_eos=True))
    assert len(out["token_ids"]) == 16 and out["finish_reason"] == "length"
