"""gateway/tools.py: tools and tool_choice checked (each bad value a ToolError naming its field),
the functions and calls rendered into the conversation, the forced call's schema (what the grammar
compiles: every call it admits parses back and validates), and generated text parsed into
OpenAI tool_calls. The real model and server: tests/e2e/test_smollm_tools.py."""
from __future__ import annotations

import json

import pytest

from specsplit.gateway.tools import MAX_TOOLS, ToolError, parse_calls, plan_tools, render_messages
from specsplit.sampling.params import MAX_GRAMMAR_CHARS

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}


@pytest.mark.parametrize("tools, choice, param, words", [
    (None, "auto", "tool_choice", "needs tools"),
    ([WEATHER], "sometimes", "tool_choice", "must be one of"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice", "'nope', which is not in tools"),
    ([WEATHER], {"type": "function"}, "tool_choice", "as an object"),
    ([WEATHER] * (MAX_TOOLS + 1), "auto", "tools", f"at most {MAX_TOOLS}"),
    ([WEATHER, WEATHER], "auto", "tools", "given twice"),
    ([{"type": "retrieval"}], "auto", "tools", "only function tools"),
    ([{"type": "function", "function": {"name": "has space"}}], "auto", "tools", "function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], "auto", "tools", "parameters must be"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"description": "x" * MAX_GRAMMAR_CHARS}}}],
     "auto", "tools", f"at most {MAX_GRAMMAR_CHARS}"),
])
def test_bad_tools_name_the_field(tools, choice, param, words):
    with pytest.raises(ToolError) as err:
        plan_tools(tools, choice)
    assert err.value.param == param and words in str(err.value), str(err.value)


def test_modes():
    assert plan_tools(None, None) is None and plan_tools([], "none") is None
    assert plan_tools([WEATHER], None).mode == "auto"
    assert not plan_tools([WEATHER], "none").renders
    req = plan_tools([WEATHER, TIME], "required")
    assert req.forced and req.allowed == ("get_weather", "get_time")
    named = plan_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}})
    assert named.mode == "named" and named.allowed == ("get_time",)


def test_forced_schema_admits_exactly_the_allowed_calls():
    jsonschema = pytest.importorskip("jsonschema")
    plan = plan_tools([WEATHER, TIME], "required")
    schema = json.loads(plan.grammar_text())
    good = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}
    jsonschema.validate(good, schema)
    for bad in ({"name": "get_weather", "arguments": {}}, {"name": "other", "arguments": {}},
                {"name": "get_time", "arguments": {"zone": "UTC"}, "extra": 1}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    content, calls = parse_calls(json.dumps(good), plan)
    assert content is None and calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == good["arguments"]


def test_render_functions_calls_and_tool_results():
    plan = plan_tools([WEATHER], "auto")
    turns = render_messages([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "18 C, sunny", "tool_call_id": "call_1"},
    ], plan.functions)
    assert [t["role"] for t in turns] == ["system", "user", "assistant", "user"]
    assert "<tools>" in turns[0]["content"] and '"name": "get_weather"' in turns[0]["content"]
    assert turns[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert turns[3]["content"] == "<tool_response>\n18 C, sunny\n</tool_response>"
    # a system message of the caller's keeps its text first; tool_choice none renders no functions
    turns = render_messages([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
                            plan.functions)
    assert turns[0]["content"].startswith("Be brief.\n\n# Tools")
    assert render_messages([{"role": "user", "content": "hi"}], ()) == [{"role": "user", "content": "hi"}]
    with pytest.raises(ToolError) as err:
        render_messages([{"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "get_weather", "arguments": "{not json"}}]}], plan.functions)
    assert err.value.param == "messages" and "messages[0].tool_calls[0].function.arguments" in str(err.value)


def test_parse_calls():
    plan = plan_tools([WEATHER, TIME], "auto")
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}')  # the last one cut at the stop token
    content, calls = parse_calls(text, plan)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"zone": "CET"}
    assert len({c["id"] for c in calls}) == 2
    # unknown names and broken JSON stay text; tool_choice none never parses
    for text in ('<tool_call>{"name": "nope", "arguments": {}}</tool_call>', "<tool_call>{broken</tool_call>",
                 "The weather is fine."):
        assert parse_calls(text, plan) == (text, [])
    call = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    assert parse_calls(call, plan_tools([WEATHER], "none")) == (call, [])
