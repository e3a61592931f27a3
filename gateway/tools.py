"""OpenAI function calling (`tools`, `tool_choice`) for the chat API: the functions rendered into
the conversation, the grammar that forces a call, and the generated text parsed back into
`tool_calls`. No HTTP here: gateway/http_api.py calls these and turns ToolError into a 400; the
gRPC servicer's Tokenizer renders through gateway/chat_prompt.py (ToolError: INVALID_ARGUMENT).

Rendering (gateway/chat_prompt.py decides which, once per tokenizer). A chat template that takes
`tools` (Qwen2.5's, Hermes 2 Pro's, Llama 3.1's) renders them itself: template_messages gives it the
conversation in transformers' documented form. SmolLM2-135M-Instruct's does not (it ignores the
argument), so for such templates the gateway renders them, in the Hermes / Qwen2.5 style that
small instruct models have seen most (render_messages):

  * a system block listing each function's JSON (name, description, parameters) inside
    <tools></tools> and asking for <tool_call>{"name": ..., "arguments": {...}}</tool_call>; it is
    appended to the conversation's first system message, or is the first message when there is
    none (which replaces the template's default system prompt);
  * an assistant message's `tool_calls` become its <tool_call> blocks after its content;
  * a `role: "tool"` message becomes a user turn holding <tool_response>...</tool_response>.

tool_choice:

  "none"      no functions rendered, no grammar, no parsing: a plain answer;
  "auto"      the functions rendered; the answer parsed for calls (default when tools are sent);
  "required"  and {"type": "function", "function": {"name": ...}}: the functions rendered and the
              output forced through the structured-output grammar (a JSON schema): one JSON object
              {"name": <an allowed name>, "arguments": <that function's parameters schema>}, so the
              answer is always one call whose arguments match the schema (unless max_tokens cuts it:
              finish_reason "length", the text as content).

Parsing: <tool_call>{...}</tool_call> blocks (Hermes, Qwen2.5; the last one may be unterminated at
the stop token), or an answer that is one bare JSON object {"name": <a known function>,
"arguments": {...}} or a list of them (Llama 3.1 writes "parameters" for "arguments", after an
optional <|python_tag|>; both are read); a call whose JSON does not parse or names an unknown
function stays text. Calls found: `tool_calls` with
ids "call_<24 hex>", `arguments` as a JSON string, the remaining text as `content` (null when
none; its trailing whitespace dropped, and its leading whitespace when the answer opens with a
call) and finish_reason "tool_calls" (a stopped answer; a cut one keeps "length").

Streaming: gateway/tool_stream.py's ToolCallStream reads the answer as it comes and sends what
parse_calls will return as soon as the text decides it: content deltas, and for each call a header
then its arguments' JSON text in pieces (its notes say what is held back and when).
"""
from __future__ import annotations

import dataclasses
import json
import re
import uuid

from specsplit.sampling.params import MAX_GRAMMAR_CHARS

MAX_TOOLS = 64
MAX_TOOL_NAME_CHARS = 64  # OpenAI's rule: a-z, A-Z, 0-9, underscores and dashes, at most 64
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
TOOL_CHOICES = ("none", "auto", "required")

__all__ = ["MAX_TOOLS", "Function", "ToolError", "ToolPlan", "arguments_text", "call_id", "finish_reason", "functions_of",
           "message_calls", "normalize_calls", "parse_calls", "plan_tools", "render_messages", "template_messages"]


class ToolError(ValueError):
    """A bad tools / tool_choice / message field: an HTTP 400 naming `param`."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclasses.dataclass(frozen=True)
class Function:
    name: str
    description: str
    parameters: dict  # a JSON schema of the arguments object

    def spec(self) -> dict:
        out = {"name": self.name}
        if self.description:
            out["description"] = self.description
        out["parameters"] = self.parameters
        return {"type": "function", "function": out}


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    """What a request's tools and tool_choice mean: the functions, the mode and (forced modes) the
    names allowed."""

    functions: tuple[Function, ...]
    mode: str  # "none" | "auto" | "required" | "named"
    allowed: tuple[str, ...] = ()

    @property
    def renders(self) -> bool:
        return self.mode != "none" and bool(self.functions)

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")

    def schema(self) -> dict:
        """The JSON schema of a forced call: {"name": <allowed>, "arguments": <its parameters>}."""
        by_name = {f.name: f for f in self.functions}
        branches = [{"type": "object", "properties": {"name": {"const": name}, "arguments": _arguments(by_name[name])},
                     "required": ["name", "arguments"], "additionalProperties": False} for name in self.allowed]
        return branches[0] if len(branches) == 1 else {"anyOf": branches}

    def grammar_text(self) -> str:
        """The forced call's schema as the json_schema grammar's text (bounded like any other)."""
        text = json.dumps(self.schema())
        if len(text) > MAX_GRAMMAR_CHARS:
            raise ToolError(f"the tools' parameter schemas make a {len(text)}-character grammar for tool_choice "
                            f"{self.mode}; at most {MAX_GRAMMAR_CHARS} are allowed (fewer or smaller tools)", "tools")
        return text


def _arguments(f: Function) -> dict:
    p = dict(f.parameters) if f.parameters else {"type": "object", "properties": {}}
    p.setdefault("type", "object")
    return p


def functions_of(tools: list) -> tuple[Function, ...]:
    """OpenAI tool specs, checked (ToolError, param "tools") -> Function entries."""
    if not isinstance(tools, list):
        raise ToolError("tools must be a list of {\"type\": \"function\", \"function\": {...}}", "tools")
    if len(tools) > MAX_TOOLS:
        raise ToolError(f"tools has {len(tools)} entries; at most {MAX_TOOLS} are allowed", "tools")
    out, seen = [], set()
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(t.get("function"), dict):
            raise ToolError(f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., "parameters": '
                            '{...}}}} (only function tools are supported)', "tools")
        fn = t["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ToolError(f"tools[{i}].function.name must be 1 to {MAX_TOOL_NAME_CHARS} characters of a-z, A-Z, 0-9, "
                            f"_ and -, got {name!r}", "tools")
        if name in seen:
            raise ToolError(f"tools[{i}].function.name {name!r} is given twice; function names must be unique", "tools")
        seen.add(name)
        description = fn.get("description") or ""
        if not isinstance(description, str):
            raise ToolError(f"tools[{i}].function.description must be a string", "tools")
        params = fn.get("parameters")
        if params is None:
            params = {}
        if not isinstance(params, dict):
            raise ToolError(f"tools[{i}].function.parameters must be a JSON schema object, got {type(params).__name__}",
                            "tools")
        size = len(json.dumps(params))
        if size > MAX_GRAMMAR_CHARS:
            raise ToolError(f"tools[{i}].function.parameters is {size} characters; at most {MAX_GRAMMAR_CHARS} are "
                            "allowed (simplify the schema)", "tools")
        out.append(Function(name, description, params))
    return tuple(out)


def plan_tools(tools: list | None, tool_choice) -> ToolPlan | None:
    """A request's tools and tool_choice, checked (ToolError names the field); None: neither sent."""
    if not tools:
        if tool_choice is None or tool_choice == "none":
            return None
        raise ToolError("tool_choice needs tools: send the functions the model may call in tools", "tool_choice")
    functions = functions_of(tools)
    if tool_choice is None:
        tool_choice = "auto"
    if isinstance(tool_choice, str):
        if tool_choice not in TOOL_CHOICES:
            raise ToolError(f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or "
                            f'{{"type": "function", "function": {{"name": ...}}}}, got {tool_choice!r}', "tool_choice")
        allowed = tuple(f.name for f in functions) if tool_choice == "required" else ()
        return ToolPlan(functions, tool_choice, allowed)
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type", "function") != "function" or not isinstance(name, str):
        raise ToolError('tool_choice as an object must be {"type": "function", "function": {"name": ...}}', "tool_choice")
    if name not in {f.name for f in functions}:
        raise ToolError(f"tool_choice names the function {name!r}, which is not in tools "
                        f"({', '.join(f.name for f in functions)})", "tool_choice")
    return ToolPlan(functions, "named", (name,))


# ---- rendering -------------------------------------------------------------------------------
def system_block(functions: tuple[Function, ...]) -> str:
    listed = "\n".join(json.dumps(f.spec(), ensure_ascii=False) for f in functions)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{listed}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def normalize_calls(calls, where: str) -> list[dict]:
    """An assistant message's OpenAI tool_calls, checked: [{"id", "type": "function", "function":
    {"name", "arguments": <a dict>}}] (arguments given as JSON text are parsed), as chat templates
    take them. ToolError (param "messages") naming the bad entry."""
    if not isinstance(calls, list):
        raise ToolError(f"{where} must be a list", "messages")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ToolError(f'{at} must be {{"id": ..., "type": "function", "function": {{"name": ..., '
                            '"arguments": "<JSON text>"}}}}', "messages")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise ToolError(f"{at}.function.arguments is not JSON text: {args[:80]!r}", "messages") from None
        if not isinstance(args, dict):
            raise ToolError(f"{at}.function.arguments must be a JSON object, got {type(args).__name__}", "messages")
        call_id_ = call.get("id")
        out.append({"id": call_id_ if isinstance(call_id_, str) else "", "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})
    return out


def message_calls(m: dict, i: int) -> list[dict]:
    """Message i's tool_calls, checked and normalized (normalize_calls); [] when it has none."""
    calls = m.get("tool_calls")
    if not calls:
        return []
    if m["role"] != "assistant":
        raise ToolError(f"messages[{i}].tool_calls is only allowed on assistant messages, not {m['role']!r}", "messages")
    return normalize_calls(calls, f"messages[{i}].tool_calls")


def _call_text(call: dict) -> str:
    fn = call["function"]
    return ("<tool_call>\n" + json.dumps({"name": fn["name"], "arguments": fn["arguments"]}, ensure_ascii=False)
            + "\n</tool_call>")


def render_messages(messages: list[dict], functions=()) -> list[dict]:
    """The fallback for a chat template that takes no tools: OpenAI chat messages ({"role",
    "content", "tool_calls"?, "tool_call_id"?}, content as text) -> plain role/content turns, with
    the functions as a Hermes system block, calls as <tool_call> blocks and tool results as user
    turns of <tool_response>. functions: Function entries (none: no block)."""
    out = []
    for i, m in enumerate(messages):
        role, content = m["role"], m.get("content") or ""
        if role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
            continue
        calls = message_calls(m, i)
        if calls:
            content = "\n".join(([content] if content else []) + [_call_text(c) for c in calls])
        out.append({"role": role, "content": content})
    if functions:
        block = system_block(tuple(functions))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": (out[0]["content"] + "\n\n" + block).lstrip()}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def template_messages(messages: list[dict]) -> list[dict]:
    """For a chat template that takes tools: OpenAI chat messages -> transformers' documented form,
    an assistant's tool_calls with `arguments` as a dict, a tool message with role "tool", its
    content, its tool_call_id and (when an earlier call has that id) the function's name."""
    out, names = [], {}
    for i, m in enumerate(messages):
        turn = {"role": m["role"], "content": m.get("content") or ""}
        calls = message_calls(m, i)
        if calls:
            turn["tool_calls"] = calls
            names.update((c["id"], c["function"]["name"]) for c in calls if c["id"])
        if m["role"] == "tool" and m.get("tool_call_id"):
            turn["tool_call_id"] = m["tool_call_id"]
            if m["tool_call_id"] in names:
                turn["name"] = names[m["tool_call_id"]]
        out.append(turn)
    return out


# ---- parsing ---------------------------------------------------------------------------------
_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)
_PYTHON_TAG = re.compile(r"^<\|python_tag\|>")  # Llama 3.1's mark before a JSON call


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(obj, names: frozenset[str]) -> dict | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    arguments = arguments_text(obj.get("arguments", obj.get("parameters", {})))
    if arguments is None:
        return None
    return {"id": call_id(), "type": "function", "function": {"name": obj["name"], "arguments": arguments}}


def arguments_text(args) -> str | None:
    """A call's `arguments` as parse_calls gives them: the object (or a JSON string holding one) as
    JSON text; None where they are not an object."""
    if isinstance(args, str):
        args = _json(args)
    return json.dumps(args, ensure_ascii=False) if isinstance(args, dict) else None


def _json(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def parse_calls(text: str, plan: ToolPlan) -> tuple[str | None, list[dict]]:
    """The generated text -> (content, tool_calls). No calls found: (text, [])."""
    if not plan.renders:
        return text, []
    names = frozenset(plan.allowed or [f.name for f in plan.functions])
    whole = _json(_PYTHON_TAG.sub("", text.strip(), count=1).strip())
    listed = whole if isinstance(whole, list) and whole else [whole]
    calls = [_call(obj, names) for obj in listed]
    if all(c is not None for c in calls):
        return None, calls
    calls, rest, last = [], [], 0
    for m in _BLOCK.finditer(text):
        call = _call(_json(m.group(1).strip()), names)
        if call is None:
            continue
        calls.append(call)
        rest.append(text[last:m.start()])
        last = m.end()
    if not calls:
        return text, []
    rest.append(text[last:])
    content = "".join(rest).rstrip()
    if not rest[0].strip():  # the answer opens with a call: no leading whitespace either
        content = content.lstrip()
    return content or None, calls


def finish_reason(calls: list, finish: str | None) -> str | None:
    """An answer with calls that stopped finishes with "tool_calls"; one cut short keeps "length"."""
    return "tool_calls" if calls and finish == "stop" else finish
