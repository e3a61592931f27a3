"""On the real SmolLM2-135M: OpenAI function calling (tools, tool_choice) through a real
`specsplit serve --http-port` with speculation on (the n-gram proposer, K = 4), driven by the
official `openai` client, and lossless under speculation.

  * tool_choice "required" and a named function always give one parseable call whose arguments
    validate against that function's parameters schema (several tools and prompts, greedy), with
    finish_reason "tool_calls" and null content; streamed, the call comes in delta.tool_calls;
  * streamed with tools (tool_choice auto and required; auto with a response_format that makes
    the model write one call or a list of two), the answer is the non-streamed one: the
    same content, the same calls (each a header, then its arguments: whole, as the server's
    default --tool-call-stream decided sends them), the same finish_reason and logprobs; a plain answer comes as it is
    generated (several content deltas before the finish), not held back to the end;
  * "none" gives plain content; a multi-turn conversation with an assistant's tool_calls and a
    tool message is accepted;
  * bad tools / tool_choice / messages are a 400 naming the field;
  * greedy, colocated: speculative (n-gram; the target as its own unconstrained draft; the EAGLE-3
    head + n-gram, the head masked by the grammar) == target-only
    for tool_choice "required" (the same prompt rendering and grammar the HTTP API builds), up to a
    certified near-tie of the constrained target (tests/helpers/greedy.py).
"""
from __future__ import annotations

import json

import pytest

from specsplit.config import EngineConfig, SpecConfig
from specsplit.factory import build_colocated
from specsplit.gateway.service import Tokenizer
from specsplit.gateway.tools import plan_tools
from specsplit.request import GenerationRequest
from specsplit.sampling.params import Grammar, SamplingParams
from specsplit.scheduler import Scheduler
from tests.helpers.greedy import assert_greedy_equal_or_tie, native_next_logits
from tests.helpers.structured import constrained_next_logits, serve_smollm_http
from tests.services.procs import HOST

pytestmark = [pytest.mark.smollm, pytest.mark.slow]
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

MODEL = "smollm2-135m"
EAGLE3 = "smollm2-135m-eagle3+ngram"  # serve's default draft: the head masks its drafts with the grammar


def _fn(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required}}}


WEATHER = _fn("get_weather", "Get the current weather in a city.",
              {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, ["city"])
TIME = _fn("get_time", "Get the local time in a timezone.", {"timezone": {"type": "string"}}, ["timezone"])
EMAIL = _fn("send_email", "Send an email.", {"to": {"type": "string"}, "subject": {"type": "string"},
                                             "body": {"type": "string"}}, ["to", "subject", "body"])
ADD = _fn("add", "Add two integers.", {"a": {"type": "integer"}, "b": {"type": "integer"}}, ["a", "b"])
TOOLS = [WEATHER, TIME, EMAIL, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
PROMPTS = ["What is the weather in Paris?", "What time is it in Tokyo?",
           "Email bob@example.com that the meeting moved to 3pm.", "What is 17 plus 25?"]
PLAIN_PROMPT = "Write two sentences about the sea."  # with tools offered, SmolLM2 answers it in words
ENGINE = dict(max_model_len=1024, max_prefill_tokens=256, max_num_seqs=2)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from serve_smollm_http(tmp_path_factory.mktemp("tools-http"), 1024)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://{HOST}:{server.http_port}/v1", api_key="unused", max_retries=0, timeout=300)


def _call(client, prompt: str, tool_choice, tools=TOOLS, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], tools=tools,
                                          tool_choice=tool_choice, temperature=0, max_tokens=96, **kw)


def _check_one_call(choice, allowed: set[str]) -> dict:
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None and len(choice.message.tool_calls) == 1, choice.message
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in allowed
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return {"name": call.function.name, "arguments": args}


@pytest.mark.parametrize("prompt", PROMPTS)
def test_required_always_gives_a_schema_valid_call(client, prompt):
    _check_one_call(_call(client, prompt, "required").choices[0], set(SCHEMAS))


@pytest.mark.parametrize("name, prompt", [("get_weather", PROMPTS[0]), ("send_email", PROMPTS[2]),
                                          ("add", PROMPTS[3]), ("get_time", PROMPTS[0])])  # the last: a mismatched one
def test_named_function_always_gives_its_call(client, name, prompt):
    got = _check_one_call(_call(client, prompt, {"type": "function", "function": {"name": name}}).choices[0], {name})
    assert got["name"] == name


def test_streamed_call_equals_the_answer(client):
    whole = _check_one_call(_call(client, PROMPTS[0], "required").choices[0], set(SCHEMAS))
    calls, finish = {}, None
    for chunk in _call(client, PROMPTS[0], "required", stream=True):
        for d in chunk.choices:
            for tc in d.delta.tool_calls or ():
                c = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                c["name"] += tc.function.name or ""
                c["arguments"] += tc.function.arguments or ""
            finish = d.finish_reason or finish
    assert finish == "tool_calls" and list(calls) == [0]
    assert calls[0]["name"] == whole["name"] and json.loads(calls[0]["arguments"]) == whole["arguments"]


def _streamed(client, prompt: str, tool_choice, **kw) -> dict:
    """A streamed answer, joined: content, calls [(name, arguments)], finish_reason, the number of
    content deltas, and the logprobs' tokens."""
    out = {"content": "", "calls": {}, "finish": None, "content_deltas": 0, "logprobs": []}
    for chunk in _call(client, prompt, tool_choice, stream=True, **kw):
        for d in chunk.choices:
            if d.delta.content:
                out["content"] += d.delta.content
                out["content_deltas"] += 1
            for tc in d.delta.tool_calls or ():
                if tc.index not in out["calls"]:  # its header: id, type, name, arguments ""
                    assert tc.id.startswith("call_") and tc.type == "function" and tc.function.arguments == "", tc
                    out["calls"][tc.index] = (tc.function.name, "")
                else:
                    assert tc.id is None and tc.function.name is None, tc
                    name, args = out["calls"][tc.index]
                    out["calls"][tc.index] = (name, args + tc.function.arguments)
            if d.logprobs is not None:
                out["logprobs"] += [t.token for t in d.logprobs.content or ()]
            out["finish"] = d.finish_reason or out["finish"]
    assert list(out["calls"]) == list(range(len(out["calls"])))
    out["calls"] = list(out["calls"].values())
    return out


def _whole(client, prompt: str, tool_choice, **kw) -> dict:
    choice = _call(client, prompt, tool_choice, **kw).choices[0]
    return {"content": choice.message.content or "", "finish": choice.finish_reason,
            "calls": [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()],
            "logprobs": [t.token for t in choice.logprobs.content] if choice.logprobs else []}


@pytest.mark.parametrize("tool_choice, prompt", [("auto", p) for p in PROMPTS] + [("required", p) for p in PROMPTS[:2]])
def test_streamed_with_tools_equals_the_answer(client, tool_choice, prompt):
    whole = _whole(client, prompt, tool_choice, logprobs=True)
    streamed = _streamed(client, prompt, tool_choice, logprobs=True)
    assert {k: streamed[k] for k in whole} == whole
    assert whole["logprobs"]  # every token's, streamed too (none lost while the text was held back)


@pytest.mark.parametrize("calls", [1, 2])
def test_auto_calls_stream_as_the_answer(client, calls):
    """SmolLM2 answers "auto" in words, so a response_format holding the forced call's schema (one
    call, or a list of two) makes it write calls while tool_choice stays auto: the auto parser
    streams them (a bare object, a bare list), equal to the non-streamed answer."""
    one = plan_tools([WEATHER, TIME], "required").schema()
    schema = one if calls == 1 else {"type": "array", "items": one, "minItems": 2, "maxItems": 2}
    prompt = PROMPTS[0] if calls == 1 else "What is the weather in Paris and the time in Tokyo?"
    kw = dict(response_format={"type": "json_schema", "json_schema": {"name": "calls", "schema": schema}}, logprobs=True)
    whole = _whole(client, prompt, "auto", **kw)
    assert len(whole["calls"]) == calls and whole["finish"] == "tool_calls" and whole["content"] == "", whole
    streamed = _streamed(client, prompt, "auto", **kw)
    assert {k: streamed[k] for k in whole} == whole


def test_a_plain_answer_with_tools_streams_as_it_comes(client):
    """Tools offered (auto), the model answers in words: the content comes in many deltas before
    the finish (only a possible call's start and whitespace are ever held back)."""
    prompt = PLAIN_PROMPT
    whole = _whole(client, prompt, "auto")
    assert not whole["calls"] and whole["content"], whole
    streamed = _streamed(client, prompt, "auto")
    assert {k: streamed[k] for k in whole} == whole
    assert streamed["content_deltas"] > 1


def test_none_is_plain_content_and_a_tool_conversation_is_accepted(client):
    r = _call(client, PROMPTS[0], "none").choices[0]
    assert r.message.tool_calls is None and r.message.content and r.finish_reason in ("stop", "length")
    messages = [{"role": "user", "content": PROMPTS[0]},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature_c": 18, "sky": "sunny"}'}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=32)
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls


@pytest.mark.parametrize("kw, param, words", [
    ({"tool_choice": "required", "tools": None}, "tool_choice", "needs tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not in tools"),
    ({"tool_choice": "maybe"}, "tool_choice", "must be one of"),
    ({"tool_choice": "auto", "tools": [WEATHER] * 65}, "tools", "at most 64"),
    ({"tool_choice": "auto", "tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "function.name"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format", "cannot be combined"),
])
def test_bad_tool_requests_are_400_naming_the_field(client, kw, param, words):
    kw = {"tools": TOOLS, **kw}
    if kw["tools"] is None:
        del kw["tools"]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, **kw)
    body = err.value.body
    assert body["param"] == param and words in body["message"], body


# ---- greedy: speculative == target-only with tool_choice "required" ---------------------------
@pytest.fixture(scope="module")
def greedy_runs():
    plan = plan_tools(TOOLS, "required")
    params = SamplingParams(grammar=Grammar("json_schema", plan.grammar_text()))
    out = {}
    for draft, k in ((None, 0), ("ngram", 4), (MODEL, 4), (EAGLE3, 4)):
        dc = None if draft is None else EngineConfig(model=draft, **ENGINE)
        colo = build_colocated(EngineConfig(model=MODEL, **ENGINE), dc, SpecConfig(num_speculative_tokens=k),
                               show_progress=False)
        tok = Tokenizer(colo.tokenizer)  # the servicer's rendering (gateway/chat_prompt.py: the Hermes fallback)
        prompts = [tuple(tok.encode_chat([{"role": "user", "content": p}], TOOLS)) for p in PROMPTS]
        reqs = [GenerationRequest(f"r{i}", p, 64, params=params) for i, p in enumerate(prompts)]
        states = Scheduler(colo.decoder, colo.eos_token_ids, 2).run(reqs)
        out[draft] = (prompts, [s.output for s in states], sum(s.proposed for s in states))
        if draft is None:
            out["tokenizer"], out["compiler"] = colo.tokenizer, colo.target.grammars
            out["next_logits"] = native_next_logits(colo.target_model.model)
        colo.close()
    out["params"] = params
    return out


@pytest.mark.parametrize("draft", ["ngram", MODEL, EAGLE3])
def test_speculative_tool_call_equals_target_only(greedy_runs, draft):
    prompts, ref, _ = greedy_runs[None]
    _, outs, proposed = greedy_runs[draft]
    assert proposed > 0
    for p, r, o in zip(prompts, ref, outs):
        assert_greedy_equal_or_tie(r, constrained_next_logits(greedy_runs["next_logits"], greedy_runs["params"], len(p),
                                                              greedy_runs["compiler"]), o, prompt=p)
    for r in ref:  # and the reference itself is a call
        call = json.loads(greedy_runs["tokenizer"].decode(r, skip_special_tokens=True))
        jsonschema.validate(call["arguments"], SCHEMAS[call["name"]])
