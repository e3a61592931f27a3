"""A grammar and penalties over real gRPC: split (the verifier process compiles the grammar from its
own tokenizer and holds the matcher) and colocated both give the target-only tokens with the same
grammar and penalties; bad values are INVALID_ARGUMENT with the rule in the message."""
from __future__ import annotations

import json

import grpc
import pytest

from specsplit.sampling.params import Grammar, SamplingParams
from specsplit.v1 import common_pb2
from tests.helpers.greedy import assert_greedy_equal_or_tie
from tests.helpers.structured import constrained_next_logits
from tests.services.procs import generate, request, service_info

MAX_TOKENS = 16
REGEX = "((w1|w2|w3|w4|w5|w6|w7|w8|w9)(w100|w101|w102|w103|w104|w105|w106|w107|w108|w109))+"
PENALTIES = dict(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.25)
BIAS = {12: 3.0, 13: -100.0}


@pytest.fixture(scope="module")
def constrained_reference(tiny_llama):
    """Target-only greedy tokens with the grammar and penalties, and the compiler (in-process)."""
    from tests.helpers.structured import constrained_target

    with constrained_target(tiny_llama, MAX_TOKENS) as ref:
        yield ref


def _params() -> SamplingParams:
    return SamplingParams(grammar=Grammar("regex", REGEX), logit_bias=tuple(sorted(BIAS.items())), **PENALTIES)


def _request(ids):
    req = request(ids, max_tokens=MAX_TOKENS, grammar=common_pb2.Grammar(regex=REGEX), **PENALTIES)
    for t, b in BIAS.items():
        req.logit_bias[t] = b
    return req


def test_grammar_and_penalties_split_and_colocated_equal_target_only(split_stack, colocated_stack, prompts,
                                                                     constrained_reference, target_logits):
    run, compiler = constrained_reference
    params = _params()
    for ids in prompts[:4]:
        expected = run(ids, params)
        for stack in (split_stack, colocated_stack):
            out = generate(stack.gateway, _request(ids))
            f = constrained_next_logits(target_logits, params, len(ids), compiler)
            assert_greedy_equal_or_tie(expected, f, out["token_ids"], prompt=ids)
            compiler.state(params.grammar).sync(out["token_ids"])  # in the grammar, token by token
            assert 13 not in out["token_ids"]


@pytest.mark.parametrize("fields, needle", [
    (dict(presence_penalty=2.5), "presence_penalty must be in [-2, 2]"),
    (dict(repetition_penalty=11.0), "repetition_penalty must be in [0.01, 10]"),
    (dict(grammar=common_pb2.Grammar(regex="(w1")), "does not compile"),
    (dict(grammar=common_pb2.Grammar(ebnf="root ::= " + " | ".join(['"w1"'] * 20000))), "at most 65536"),
    (dict(grammar=common_pb2.Grammar(json_object=True), ignore_eos=True), "ignore_eos cannot be combined"),
])
def test_bad_values_are_invalid_argument(split_stack, fields, needle):
    with pytest.raises(grpc.RpcError) as err:
        generate(split_stack.gateway, request([5, 6, 7], max_tokens=4, **fields))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in err.value.details(), err.value.details()


def test_logit_bias_outside_the_vocabulary_is_invalid_argument(split_stack):
    req = request([5, 6, 7], max_tokens=4)
    req.logit_bias[100000] = 1.0
    with pytest.raises(grpc.RpcError) as err:
        generate(split_stack.gateway, req)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "outside the vocabulary" in err.value.details()


def test_verifier_builds_its_grammar_compiler_before_serving(split_stack):
    """The verifier service builds its compiler (the target's tokenizer) after its model loads and
    before its memory profile, not on the first grammar request: the log says so before SERVING,
    and the host memory it took is inside the plan's non-torch bytes."""
    verifier = split_stack.procs["verifier"]
    log = verifier.log_path.read_text(errors="replace")
    ready = log.index("structured-output compiler ready")
    assert ready < log.index("memory plan [verifier]") < log.index("health: SERVING")
    assert "(counted in the memory plan)" in log[ready:ready + 400]
    plan = json.loads(service_info(verifier.address, "verifier").memory_plan_json)["services"]["verifier"]
    assert plan["non_torch_bytes"] > 0, plan


def test_vllm_s_guided_choice_over_http_is_exactly_one_choice(split_stack, colocated_stack):
    """vLLM's guided_choice and structured_outputs.choice over HTTP (split stack, speculation on): the
    text is one of the choices, the same for both forms and for the colocated stack's gRPC with the
    EBNF they become. (The tiny tokenizer's tokens are words its decode joins with spaces, so the
    grammar sees "w5w6w7" where the text reads "w5 w6 w7", as in REGEX above.)"""
    from specsplit.gateway.http_api import _ebnf_literal
    from tests.services.procs import http_call

    choices = ["w5w6w7", "w8w7", "w9"]  # no choice begins with a token that is only the start of a longer one
    model = json.loads(http_call(split_stack.http_port, "/v1/models")[1])["data"][0]["id"]
    texts = []
    for extra in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}}):
        status, raw = http_call(split_stack.http_port, "/v1/completions",
                                {"model": model, "prompt": [4, 5, 6], "max_tokens": 8, "temperature": 0, **extra})
        choice = json.loads(raw)["choices"][0]
        assert status == 200 and choice["text"].replace(" ", "") in choices and choice["finish_reason"] == "stop", raw
        texts.append(choice["text"])
    ebnf = "root ::= " + " | ".join(_ebnf_literal(c) for c in choices)
    colo = generate(colocated_stack.gateway, request([4, 5, 6], max_tokens=8, grammar=common_pb2.Grammar(ebnf=ebnf)))
    assert texts[0] == texts[1] and colo["text"] == texts[0]  # neither text holds the EOS token's (vLLM's rule)
