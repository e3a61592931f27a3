"""gateway/chat_prompt.py through the servicer's real Tokenizer (gateway/service.py) and a real
transformers tokenizer (tests/helpers/tiny_models.py, nothing downloaded): a chat template that
takes `tools` (a small Qwen2.5 / Hermes-like one, written here) is given the OpenAI tool specs and
the calls in transformers' form and renders them itself; SmolLM2's template (no tools) gets the
gateway's Hermes system block. The request's path from the gRPC message (tools_json,
tool_calls_json, tool_call_id) and the parsing of what such templates ask the model to write."""
from __future__ import annotations

import json

import grpc
import pytest

from specsplit.gateway.chat_prompt import ChatPrompt, takes_tools
from specsplit.gateway.service import Tokenizer
from specsplit.gateway.tools import parse_calls, plan_tools
from specsplit.rpc.wire import ServiceError
from specsplit.v1 import gateway_pb2
from tests.helpers.chat_templates import SMOLLM2_TEMPLATE, TOOLS_TEMPLATE
from tests.helpers.tiny_models import write_tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "content": "18 C, sunny", "tool_call_id": "call_1"},
]
HERMES_BLOCK = "You may call one or more functions to assist with the user query."


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer(d)
    return d


def _tokenizer(hf_dir, template):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(hf_dir)
    hf.chat_template = template
    return Tokenizer(hf)


def test_the_decision_follows_the_template_source(hf_dir):
    tok = _tokenizer(hf_dir, TOOLS_TEMPLATE)
    assert takes_tools(tok.tokenizer) and tok.chat == ChatPrompt(True) and "chat template" in tok.chat.describe()
    tok = _tokenizer(hf_dir, SMOLLM2_TEMPLATE)
    assert not takes_tools(tok.tokenizer) and tok.chat == ChatPrompt(False) and "Hermes" in tok.chat.describe()
    # several named templates: the one transformers picks when tools are given ("tool_use"), else "default"
    tok.tokenizer.chat_template = {"default": SMOLLM2_TEMPLATE, "tool_use": TOOLS_TEMPLATE}
    assert takes_tools(tok.tokenizer)
    tok.tokenizer.chat_template = {"default": SMOLLM2_TEMPLATE}
    assert not takes_tools(tok.tokenizer)


def test_a_tools_template_renders_the_tools_calls_and_results_itself(hf_dir):
    tok = _tokenizer(hf_dir, TOOLS_TEMPLATE)
    text = tok.chat_text(CONVERSATION, [WEATHER])
    assert HERMES_BLOCK not in text and "<tools>" not in text  # not the fallback block
    assert text.startswith("<|im_start|>system\nBe brief.\nTEMPLATE-TOOLS:\n")
    spec = json.loads(text.split("TEMPLATE-TOOLS:\n")[1].split("<|im_end|>")[0])
    assert spec == WEATHER  # the OpenAI spec, as transformers' tools= takes it
    # the call's arguments reach the template as a dict (its tojson writes the object, not a string)
    assert '<|im_start|>assistant\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert "<|im_start|>tool\n[call_1 get_weather] 18 C, sunny<|im_end|>\n" in text  # role tool, its id and name
    assert text.endswith("<|im_start|>assistant\n")
    # the ids are the same text, tokenized (what the scheduler gets)
    assert tok.encode_chat(CONVERSATION, [WEATHER]) == tok.tokenizer(text, add_special_tokens=False).input_ids
    # no tools sent (tool_choice none): the template's plain system turn, the calls still in its form
    text = tok.chat_text(CONVERSATION, None)
    assert "TEMPLATE-TOOLS" not in text and text.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert "[call_1 get_weather]" in text


def test_a_template_without_tools_gets_the_hermes_block(hf_dir):
    tok = _tokenizer(hf_dir, SMOLLM2_TEMPLATE)
    text = tok.chat_text(CONVERSATION, [WEATHER])
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n\n" + HERMES_BLOCK)
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call><|im_end|>') in text
    assert "<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response><|im_end|>" in text
    plain = [{"role": "user", "content": "hi"}]  # no tools: exactly what the template alone renders
    assert tok.chat_text(plain) == tok.tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=False)


def _request(tools_json: str, calls_json: str) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(max_tokens=4, tools_json=tools_json, messages=[
        gateway_pb2.ChatMessage(role="user", content="Weather in Paris?"),
        gateway_pb2.ChatMessage(role="assistant", tool_calls_json=calls_json),
        gateway_pb2.ChatMessage(role="tool", content="18 C", tool_call_id="call_1")])


def test_the_grpc_request_carries_tools_and_calls(hf_dir):
    tok = _tokenizer(hf_dir, TOOLS_TEMPLATE)
    calls = json.dumps(CONVERSATION[2]["tool_calls"])
    msg = _request(json.dumps([WEATHER]), calls)
    expected = tok.encode_chat([{"role": "user", "content": "Weather in Paris?"},
                                {"role": "assistant", "content": "", "tool_calls": CONVERSATION[2]["tool_calls"]},
                                {"role": "tool", "content": "18 C", "tool_call_id": "call_1"}], [WEATHER])
    assert tok.encode_request(msg) == expected
    for bad, words in ((_request("{", calls), "tools_json is not JSON"),
                       (_request("{}", calls), "tools_json must be a JSON list"),
                       (_request("[]", '[{"function": {"name": "f", "arguments": "{no"}}]'),
                        "messages[1].tool_calls[0].function.arguments is not JSON"),
                       (_request('[{"type": "function", "function": {"name": "bad name"}}]', ""), "function.name")):
        with pytest.raises(ServiceError) as e:
            tok.encode_request(bad)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and words in e.value.message, e.value.message


def test_what_tools_templates_make_the_model_write_parses_back():
    plan = plan_tools([WEATHER], "auto")
    for text in ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',  # Hermes / Qwen2.5
                 '{"name": "get_weather", "parameters": {"city": "Oslo"}}',  # Llama 3.1
                 '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}'):
        content, calls = parse_calls(text, plan)
        assert content is None and len(calls) == 1, text
        assert calls[0]["function"]["name"] == "get_weather"
        assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    content, calls = parse_calls('[{"name": "get_weather", "parameters": {"city": "Oslo"}}, '
                                 '{"name": "get_weather", "arguments": {"city": "Rome"}}]', plan)
    assert content is None and [json.loads(c["function"]["arguments"])["city"] for c in calls] == ["Oslo", "Rome"]
    for text in ('[{"name": "get_weather", "parameters": {}}, {"name": "nope", "arguments": {}}]', "[]"):
        assert parse_calls(text, plan) == (text, [])  # one unknown call: all of it stays text
