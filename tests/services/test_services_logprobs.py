"""GenerateRequest.logprobs and the per-message draft counts through real services (split: the
verifier sends them over its session; colocated: in-process): one TokenLogprob per streamed token
with n alternatives, equal to log_softmax of the target's logits (a transformers target-only
forward, 1e-4); greedy tokens unchanged; proposed/accepted per message add up to usage; none when
not asked; logprobs above 20 refused with INVALID_ARGUMENT."""
from __future__ import annotations

import grpc
import pytest

from specsplit.v1 import gateway_pb2_grpc
from tests.helpers.logprobs import check_streamed_logprobs as _check
from tests.services.procs import request


def _stream(address, req) -> list:
    with grpc.insecure_channel(address) as ch:
        return list(gateway_pb2_grpc.GatewayStub(ch).Generate(req, timeout=60))


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
