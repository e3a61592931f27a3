"""Prompt log-probabilities through real services, split (the verifier service scores the prompt
in its prefill and sends them over its session) and colocated: `/v1/completions` with echo and
logprobs (what lm-eval's local-completions sends for every loglikelihood task), and the gRPC API's
prompt_logprobs, each equal to log_softmax of the target's fp32 logits at every prompt position (a
transformers forward of the prompt, 1e-4); greedy completions unchanged by echo; the bounds as 400
/ INVALID_ARGUMENT; nothing left allocated."""
from __future__ import annotations

import json

import grpc
import pytest
import torch

from specsplit.v1 import gateway_pb2, gateway_pb2_grpc
from tests.helpers.logprobs import TOL
from tests.services.procs import free_port, http_call, request, start_colocated, wait_for


@pytest.fixture(scope="module")
def colocated_http(tmp_path_factory, tiny_llama, tiny_draft_close):
    """`specsplit serve` with the HTTP API (the session's colocated stack has none)."""
    stack = start_colocated(tmp_path_factory.mktemp("colocated-http-logs"), tiny_llama, tiny_draft_close,
                            extra=("--http-port", str(free_port())))
    try:
        yield stack.ready()
    finally:
        stack.stop()


@pytest.fixture
def stack_of(request):  # pytest's `request`: a stack by fixture name
    return request.getfixturevalue


STACKS = ["split_stack", "colocated_http"]


def _reference(model, prompt) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([list(prompt)])).logits[0].float(), dim=-1)  # [P, V]


def _complete(stack, **body) -> tuple[int, dict]:
    status, raw = http_call(stack.http_port, "/v1/completions", {"model": _model(stack), **body})
    return status, json.loads(raw)


def _model(stack) -> str:
    status, raw = http_call(stack.http_port, "/v1/models")
    assert status == 200
    return json.loads(raw)["data"][0]["id"]


def _idle(stack) -> bool:
    with grpc.insecure_channel(stack.gateway) as ch:
        info = gateway_pb2_grpc.GatewayStub(ch).GetServerInfo(gateway_pb2.GetServerInfoRequest(), timeout=5)
    (verifier,) = [x for x in info.services if x.name == "verifier"]
    return info.num_running == 0 and info.num_waiting == 0 and verifier.kv.free_blocks == verifier.kv.num_blocks


@pytest.mark.parametrize("stack", STACKS)
def test_echo_logprobs_equal_the_target_s_log_softmax(stack_of, stack, prompts, hf_target):
    """lm-eval's request (max_tokens 1, logprobs 1, echo, temperature 0) and max_tokens 0: every
    prompt token's logprob after the first (the first null) and its best alternative == the
    reference's; the completion's one token is the target's greedy one."""
    s = stack_of(stack)
    for ids in prompts[:4] + [prompts[5][:1]]:
        ref = _reference(hf_target, ids)
        for max_tokens in (1, 0):
            status, out = _complete(s, prompt=ids, max_tokens=max_tokens, logprobs=1, echo=True, temperature=0)
            assert status == 200, out
            (c,) = out["choices"]
            lp = c["logprobs"]
            assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(ids) + max_tokens
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
            for j in range(1, len(ids)):
                assert abs(lp["token_logprobs"][j] - float(ref[j - 1, ids[j]])) < TOL, (ids, j)
                (best,) = lp["top_logprobs"][j].values()
                assert abs(best - float(ref[j - 1].max())) < TOL
            assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
            assert out["usage"]["prompt_tokens"] == len(ids) and out["usage"]["completion_tokens"] == max_tokens
            if max_tokens:
                greedy = int(ref[-1].argmax())
                assert abs(lp["token_logprobs"][-1] - float(ref[-1, greedy])) < TOL
                assert c["text"].startswith(_complete(s, prompt=ids, max_tokens=0, echo=True)[1]["choices"][0]["text"])
            else:
                assert c["finish_reason"] == "length"
    assert wait_for(lambda: _idle(s), 10.0) is not None


@pytest.mark.parametrize("stack", STACKS)
def test_echo_leaves_the_completion_alone(stack_of, stack, prompts):
    """Greedy, with speculation: the same completion with and without echo + logprobs; echo's
    text is the prompt's text then the completion's."""
    s = stack_of(stack)
    for ids in prompts[6:9]:
        _, plain = _complete(s, prompt=ids, max_tokens=12, temperature=0, ignore_eos=True)
        _, echoed = _complete(s, prompt=ids, max_tokens=12, temperature=0, ignore_eos=True, echo=True, logprobs=2)
        _, prompt_only = _complete(s, prompt=ids, max_tokens=0, echo=True)
        text = plain["choices"][0]["text"]
        assert echoed["choices"][0]["text"] == prompt_only["choices"][0]["text"] + text
        lp = echoed["choices"][0]["logprobs"]
        assert len(lp["tokens"]) == len(ids) + 12 and all(len(t) == 2 for t in lp["top_logprobs"][1:])


@pytest.mark.parametrize("stack", STACKS)
def test_grpc_prompt_logprobs_on_the_first_message(stack_of, stack, prompts, hf_target):
    s = stack_of(stack)
    ids = prompts[10]
    ref = _reference(hf_target, ids)
    with grpc.insecure_channel(s.gateway) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        msgs = list(stub.Generate(request(ids, max_tokens=6, prompt_logprobs=3), timeout=60))
        plain = list(stub.Generate(request(ids, max_tokens=6), timeout=60))
    assert [t for m in msgs for t in m.token_ids] == [t for m in plain for t in m.token_ids]
    first = msgs[0].prompt_logprobs
    assert len(first) == len(ids) - 1 and all(len(m.prompt_logprobs) == 0 for m in msgs[1:])
    for j, lp in enumerate(first):
        assert lp.token_id == ids[j + 1] and abs(lp.logprob - float(ref[j, ids[j + 1]])) < TOL
        best = ref[j].topk(3)
        assert [a.token_id for a in lp.top] == best.indices.tolist() or \
            all(abs(a.logprob - b) < TOL for a, b in zip(lp.top, best.values.tolist()))


@pytest.mark.parametrize("stack", STACKS)
def test_a_long_prompt_prefilled_in_pieces_is_scored_whole(stack_of, stack, hf_target):
    """A 200-token prompt is prefilled in pieces (--max-num-batched-tokens 128), and each piece's
    blocks enter the prefix cache before the next: every prompt token is still scored (the
    verifier once went back to position 0 at the last piece and refused its own cached blocks,
    ending the request with 400), to the reference's values."""
    from tests.helpers.prompts import spread_prompt

    s = stack_of(stack)
    ids = list(spread_prompt(41, 200))
    ref = _reference(hf_target, ids)
    status, out = _complete(s, prompt=ids, max_tokens=4, temperature=0, echo=True, logprobs=0)
    assert status == 200, out
    lp = out["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids) + 4 and lp["token_logprobs"][0] is None
    for j in range(1, len(ids)):
        assert abs(lp["token_logprobs"][j] - float(ref[j - 1, ids[j]])) < TOL, j
    assert wait_for(lambda: _idle(s), 10.0) is not None


def _rank_bounds(row: torch.Tensor, token: int) -> tuple[int, int]:
    """The ranks a token can have given the reference row [V] to TOL: tokens surely more likely
    + 1 .. tokens possibly at least as likely."""
    v = float(row[token])
    return int((row > v + TOL).sum()) + 1, int((row >= v - TOL).sum())


@pytest.mark.parametrize("stack", STACKS)
def test_vllm_prompt_logprobs_with_ranks(stack_of, stack, prompts, hf_target):
    """vLLM's prompt_logprobs on /v1/completions (in the choice): each prompt token's logprob and
    rank under the target (a transformers forward of the prompt, to TOL), its n most likely with
    ranks 1..n; the completion is the one without it (greedy, speculation on). (Chat:
    test_services_http.py, whose server has a chat template.)"""
    s = stack_of(stack)
    ranks = []
    for ids in (prompts[11], prompts[12]):
        ref = _reference(hf_target, ids)
        _, plain = _complete(s, prompt=ids, max_tokens=8, temperature=0, ignore_eos=True)
        status, out = _complete(s, prompt=ids, max_tokens=8, temperature=0, ignore_eos=True, prompt_logprobs=2)
        assert status == 200, out
        (c,) = out["choices"]
        assert c["text"] == plain["choices"][0]["text"]
        scored = c["prompt_logprobs"]
        assert len(scored) == len(ids) and scored[0] is None
        for j in range(1, len(ids)):
            entries = {int(k): v for k, v in scored[j].items()}
            mine = entries[ids[j]]
            assert abs(mine["logprob"] - float(ref[j - 1, ids[j]])) < TOL
            lo, hi = _rank_bounds(ref[j - 1], ids[j])
            assert lo <= mine["rank"] <= hi, (j, mine, lo, hi)
            ranks.append(mine["rank"])
            best = ref[j - 1].topk(2).values.tolist()
            assert ids[j] in entries and len(entries) in (2, 3)  # the prompt's token, and the 2 most likely
            for k, v in entries.items():
                if k != ids[j]:
                    assert v["rank"] in (1, 2) and abs(v["logprob"] - best[v["rank"] - 1]) < TOL, (j, entries)
    assert max(ranks) > 2  # the prompts' tokens are not all the model's first choices: the ranks say so
    assert wait_for(lambda: _idle(s), 10.0) is not None


@pytest.mark.parametrize("req,needle", [
    (dict(max_tokens=1, prompt_logprobs=21), "prompt_logprobs must be in [0, 20]"),
    (dict(max_tokens=0), "max_tokens must be >= 1 (0 only with prompt_logprobs"),
])
def test_grpc_bounds_are_invalid_argument(split_stack, prompts, req, needle):
    with grpc.insecure_channel(split_stack.gateway) as ch:
        with pytest.raises(grpc.RpcError) as e:
            list(gateway_pb2_grpc.GatewayStub(ch).Generate(request(prompts[0], **req), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in e.value.details(), e.value.details()


@pytest.mark.parametrize("body,param,needle", [
    (dict(max_tokens=0), "max_tokens", "0 only with echo"),
    (dict(max_tokens=-1, echo=True), "max_tokens", "max_tokens must be >= 0"),
    (dict(max_tokens=1, echo=True, logprobs=21), "logprobs", "logprobs must be in [0, 20]"),
    (dict(max_tokens=1, echo=True, suffix="x"), "suffix", "suffix is not supported"),
])
def test_http_bounds_are_400(split_stack, prompts, body, param, needle):
    status, out = _complete(split_stack, prompt=prompts[0], **body)
    assert status == 400 and out["error"]["param"] == param and needle in out["error"]["message"], out
