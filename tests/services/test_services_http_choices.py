"""`n` > 1 on the HTTP API and on gRPC (GenerateRequest.n, the same GatewayServicer.submit_choices)
through a real split stack (tiny pair, speculation on): greedy n choices are n copies of the
target's greedy completion; seeded n choices are reproducible, choice 0 is the seed's own n = 1
completion and choice i is seed + i's (chat's choices: the same code,
tests/unit/gateway/test_http_api.py; this target has no chat template); every choice's
request ends and frees its KV; n outside [1, 16] is a 400 / INVALID_ARGUMENT. On gRPC the choices'
messages interleave on one stream, each naming its choice (GenerateResponse.index)."""
from __future__ import annotations

import json

import grpc
import pytest

from specsplit.v1 import gateway_pb2, gateway_pb2_grpc
from tests.services.procs import http_call, wait_for


def _model(stack) -> str:
    return json.loads(http_call(stack.http_port, "/v1/models")[1])["data"][0]["id"]


def _post(stack, path, **body) -> dict:
    status, raw = http_call(stack.http_port, path, {"model": _model(stack), **body})
    assert status == 200, raw
    return json.loads(raw)


def _texts(out) -> list[str]:
    assert [c["index"] for c in out["choices"]] == list(range(len(out["choices"])))
    return [c["text"] if "text" in c else c["message"]["content"] for c in out["choices"]]


def _idle(stack) -> bool:
    with grpc.insecure_channel(stack.gateway) as ch:
        info = gateway_pb2_grpc.GatewayStub(ch).GetServerInfo(gateway_pb2.GetServerInfoRequest(), timeout=5)
    (verifier,) = [x for x in info.services if x.name == "verifier"]
    return info.num_running == 0 and verifier.kv.free_blocks == verifier.kv.num_blocks


def test_greedy_n_choices_are_the_target_s_completion(split_stack, prompts):
    ids = prompts[3]
    out = _post(split_stack, "/v1/completions", prompt=ids, max_tokens=12, temperature=0, n=3, ignore_eos=True,
                logprobs=0)
    texts = _texts(out)
    one = _post(split_stack, "/v1/completions", prompt=ids, max_tokens=12, temperature=0, ignore_eos=True)
    assert texts == [_texts(one)[0]] * 3
    tokens = out["choices"][0]["logprobs"]["tokens"]
    assert all(c["logprobs"]["tokens"] == tokens for c in out["choices"])
    assert out["usage"]["prompt_tokens"] == len(ids) and out["usage"]["completion_tokens"] == 36
    assert wait_for(lambda: _idle(split_stack), 10.0) is not None


def test_seeded_n_choices_are_reproducible_and_each_seed_s_own(split_stack, prompts):
    ids = prompts[7]
    body = dict(prompt=ids, max_tokens=10, temperature=1.0, seed=123, n=3, ignore_eos=True)
    first, again = _post(split_stack, "/v1/completions", **body), _post(split_stack, "/v1/completions", **body)
    assert _texts(first) == _texts(again)
    for i in range(3):
        alone = _post(split_stack, "/v1/completions", prompt=ids, max_tokens=10, temperature=1.0, seed=123 + i,
                      ignore_eos=True)
        assert _texts(first)[i] == _texts(alone)[0]
    assert len(set(_texts(first))) > 1  # different seeds: not all the same sample
    assert wait_for(lambda: _idle(split_stack), 10.0) is not None


@pytest.mark.parametrize("n", [0, 17])
def test_n_out_of_range_is_400(split_stack, prompts, n):
    status, raw = http_call(split_stack.http_port, "/v1/completions",
                            {"model": _model(split_stack), "prompt": prompts[0], "max_tokens": 2, "n": n})
    err = json.loads(raw)["error"]
    assert status == 400 and err["param"] == "n" and "n must be in [1, 16]" in err["message"]


# ---- gRPC ------------------------------------------------------------------------------------
def _grpc_choices(stack, **kw) -> dict[int, dict]:
    """Each choice's tokens, finish_reason and usage, from one Generate stream."""
    out: dict[int, dict] = {}
    with grpc.insecure_channel(stack.gateway) as ch:
        for r in gateway_pb2_grpc.GatewayStub(ch).Generate(gateway_pb2.GenerateRequest(**kw), timeout=60):
            c = out.setdefault(r.index, {"tokens": [], "finish": None, "usage": None})
            assert c["finish"] is None, f"choice {r.index} sent a message after its last"
            c["tokens"] += list(r.token_ids)
            if r.finish_reason:
                c["finish"], c["usage"] = r.finish_reason, r.usage
    return out


def test_grpc_greedy_n_choices_are_the_target_s_completion(split_stack, prompts):
    ids = prompts[3]
    out = _grpc_choices(split_stack, prompt_token_ids=ids, max_tokens=12, n=3, ignore_eos=True)
    (one,) = _grpc_choices(split_stack, prompt_token_ids=ids, max_tokens=12, ignore_eos=True).values()
    assert sorted(out) == [0, 1, 2]
    for c in out.values():
        assert c["tokens"] == one["tokens"] and len(c["tokens"]) == 12 and c["finish"] == "length"
        assert c["usage"].completion_tokens == 12 and c["usage"].prompt_tokens == len(ids)
    assert wait_for(lambda: _idle(split_stack), 10.0) is not None


def test_grpc_seeded_n_choices_are_each_seed_s_own(split_stack, prompts):
    ids = prompts[7]
    kw = dict(prompt_token_ids=ids, max_tokens=10, temperature=1.0, ignore_eos=True)
    out = _grpc_choices(split_stack, seed=123, n=3, **kw)
    for i in range(3):
        (alone,) = _grpc_choices(split_stack, seed=123 + i, **kw).values()
        assert out[i]["tokens"] == alone["tokens"]
    assert len({tuple(c["tokens"]) for c in out.values()}) > 1
    assert wait_for(lambda: _idle(split_stack), 10.0) is not None


def test_grpc_n_out_of_range_is_invalid_argument(split_stack, prompts):
    with pytest.raises(grpc.RpcError) as err:
        _grpc_choices(split_stack, prompt_token_ids=prompts[0], max_tokens=2, n=17)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "n must be in [1, 16], got 17" in err.value.details()
