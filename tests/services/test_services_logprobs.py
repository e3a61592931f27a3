"""GenerateRequest.logprobs and the per-message draft counts through real services (split: the
verifier sends them over its session; colocated: in-process): one TokenLogprob per streamed token
with n alternatives, equal to log_softmax of the target's logits (a transformers target-only
forward, 1e-4); greedy tokens unchanged; proposed/accepted per message add up to usage; none when
not asked; logprobs above 20 refused with INVALID_ARGUMENT."""
from __future__ import annotations

import grpc
import pytest
import torch

from protos.specsplit.v1 import gateway_pb2_grpc
from tests.services.procs import request

TOL = 1e-4


@pytest.fixture(scope="module")
def hf_target(tiny_llama):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


def _stream(address, req) -> list:
    with grpc.insecure_channel(address) as ch:
        return list(gateway_pb2_grpc.GatewayStub(ch).Generate(req, timeout=60))


def _check(model, prompt, msgs, n):
    ids = [t for m in msgs for t in m.token_ids]
    lps = [lp for m in msgs for lp in m.logprobs]
    assert all(len(m.logprobs) == len(m.token_ids) for m in msgs)
    assert [lp.token_id for lp in lps] == ids
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt) + ids])).logits[0].float()
    ref = torch.log_softmax(logits[len(prompt) - 1: len(prompt) + len(ids) - 1], dim=-1)  # [len(ids), V]
    for j, lp in enumerate(lps):
        assert abs(lp.logprob - float(ref[j, lp.token_id])) < TOL, j
        assert len(lp.top) == n
        best = ref[j].topk(n).values.tolist()
        for alt, b in zip(lp.top, best):
            assert abs(alt.logprob - float(ref[j, alt.token_id])) < TOL and abs(alt.logprob - b) < TOL
    return ids


def _counts_add_up(msgs):
    usage = msgs[-1].usage
    assert sum(m.proposed_draft_tokens for m in msgs) == usage.proposed_draft_tokens
    assert sum(m.accepted_draft_tokens for m in msgs) == usage.accepted_draft_tokens
    return usage


@pytest.mark.parametrize("stack", ["split_stack", "colocated_stack"])
def test_greedy_logprobs_stream_with_each_token(stack_of, stack, prompts, hf_target):
    address = stack_of(stack).gateway
    proposed = 0
    for ids in prompts[:3]:
        plain = _stream(address, request(ids, max_tokens=20, ignore_eos=True))
        msgs = _stream(address, request(ids, max_tokens=20, ignore_eos=True, logprobs=3))
        assert all(len(m.logprobs) == 0 for m in plain)
        out = _check(hf_target, ids, msgs, 3)
        assert out == [t for m in plain for t in m.token_ids] and len(out) == 20
        assert msgs[-1].finish_reason == "length"
        proposed += _counts_add_up(msgs).proposed_draft_tokens
        _counts_add_up(plain)
    assert proposed > 0  # the counts were not all zero: speculation ran


def test_sampled_logprobs_over_the_rejection_path(split_stack, prompts, hf_target):
    """Unseeded sampling runs the rejection sampler (q rows cross the wire): the recovered tokens
    of rejected steps carry logprobs too."""
    ids = prompts[4]
    msgs = _stream(split_stack.gateway, request(ids, max_tokens=32, ignore_eos=True, temperature=1.0, logprobs=0))
    assert len(_check(hf_target, ids, msgs, 0)) == 32
    usage = _counts_add_up(msgs)
    assert usage.proposed_draft_tokens > 0


def test_logprobs_0_carries_the_tokens_own_only(split_stack, prompts):
    msgs = _stream(split_stack.gateway, request(prompts[1], max_tokens=6, logprobs=0))
    lps = [lp for m in msgs for lp in m.logprobs]
    assert len(lps) == sum(len(m.token_ids) for m in msgs) and all(len(lp.top) == 0 for lp in lps)
    assert all(lp.logprob <= 0.0 for lp in lps)


def test_more_than_20_logprobs_is_invalid_argument(split_stack, prompts):
    with pytest.raises(grpc.RpcError) as err:
        _stream(split_stack.gateway, request(prompts[0], max_tokens=4, logprobs=21))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "logprobs must be in [0, 20]" in err.value.details()


@pytest.fixture
def stack_of(request):  # pytest's `request` (not procs.request): a session stack by fixture name
    return request.getfixturevalue
