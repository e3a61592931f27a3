"""Chat messages and function tools -> what the target's chat template is given: the one place that
decides how tools and calls are rendered (gateway/service.py Tokenizer calls it for every chat
request, gRPC and HTTP alike).

  * A template that takes tools (its Jinja source uses `tools`, as Qwen2.5's, Hermes 2 Pro's and
    Llama 3.1's do; a tokenizer with several named templates: its "tool_use" one, else its
    "default"): the OpenAI tool specs go in as apply_chat_template(tools=...), and the conversation
    in transformers' documented form (gateway/tools.py template_messages): an assistant's
    tool_calls with `arguments` as a dict, tool results as role "tool" messages. The template
    renders them as the model was trained to see them.
  * Any other template (SmolLM2-135M-Instruct's): the gateway renders them itself, Hermes style
    (gateway/tools.py render_messages): a system block listing the functions, <tool_call> blocks in
    the assistant's turns, <tool_response> user turns; the template gets plain role/content turns.

Either way the model is asked for <tool_call>{...}</tool_call> blocks or a bare JSON call, which
gateway/tools.py parse_calls reads back.
"""
from __future__ import annotations

import dataclasses
import json
import re

from specsplit.gateway.tools import ToolError, functions_of, render_messages, template_messages

__all__ = ["ChatPrompt", "loads_list", "takes_tools"]

_USES_TOOLS = re.compile(r"\btools\b")


def _source(tokenizer) -> str:
    """The Jinja source apply_chat_template(tools=...) would use ("" when there is none)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default")
    return template if isinstance(template, str) else ""


def takes_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders function tools itself (its source uses `tools`)."""
    return bool(_USES_TOOLS.search(_source(tokenizer)))


def loads_list(text: str, where: str, param: str) -> list | None:
    """JSON text holding a list (the proto's tools_json / tool_calls_json); "" -> None. ToolError."""
    if not text:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        raise ToolError(f"{where} is not JSON text: {text[:80]!r}", param) from None
    if not isinstance(value, list):
        raise ToolError(f"{where} must be a JSON list, got {type(value).__name__}", param)
    return value


@dataclasses.dataclass(frozen=True)
class ChatPrompt:
    """How one tokenizer's template is given tools: by itself (tools_in_template) or through the
    Hermes fallback."""

    tools_in_template: bool

    @classmethod
    def of(cls, tokenizer) -> "ChatPrompt":
        return cls(takes_tools(tokenizer))

    def describe(self) -> str:
        if self.tools_in_template:
            return "chat tools: rendered by the model's chat template (apply_chat_template tools=...)"
        return "chat tools: the model's chat template takes none; rendered as a Hermes-style system block"

    def inputs(self, messages: list[dict], tools: list | None) -> tuple[list[dict], list[dict] | None]:
        """OpenAI chat messages ({"role", "content", "tool_calls"?, "tool_call_id"?}) and tool specs
        (None or [] = none) -> (the template's messages, its `tools` argument). ToolError."""
        functions = functions_of(tools) if tools else ()
        if self.tools_in_template:
            return template_messages(messages), [f.spec() for f in functions] or None
        return render_messages(messages, functions), None
