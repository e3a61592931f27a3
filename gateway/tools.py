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

Streaming: ToolCallStream reads the answer as it comes and sends what parse_calls will return as
soon as the text decides it: content deltas, and for each call a header then its arguments' JSON
text in pieces (the notes above the class say what is held back and when).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import re
import uuid

from specsplit.sampling.params import MAX_GRAMMAR_CHARS

MAX_TOOLS = 64
MAX_TOOL_NAME_CHARS = 64  # OpenAI's rule: a-z, A-Z, 0-9, underscores and dashes, at most 64
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
TOOL_CHOICES = ("none", "auto", "required")
log = logging.getLogger(__name__)

__all__ = ["MAX_TOOLS", "Function", "ToolCallStream", "ToolError", "ToolPlan", "call_id", "finish_reason", "functions_of",
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
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {"id": call_id(), "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


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


# ---- streaming -------------------------------------------------------------------------------
# ToolCallStream says what parse_calls will say of an answer as soon as the text so far decides
# it. It reads the text one character at a time, in one of four modes:
#
#   start  whitespace (and Llama's <|python_tag|>) before the first character that tells the form;
#   bare   a JSON object or list at the start, read as calls (_CallReader) while it can be one;
#          once it cannot, the text is read again from its start in `text` mode;
#   text   content, with <tool_call> blocks read as calls; a block that is not one is content;
#   plain  tool_choice none: all content.
#
# Held back meanwhile: whitespace (an answer with calls has none at its end, and none at its start
# when it opens with a call), a possible "<tool_call>" prefix, and a bare JSON value that may still
# be a call. A call is sent once its name is an allowed one and its arguments have begun; what was
# sent is never taken back, so a call whose text then stops being one (max_tokens cuts it, its JSON
# breaks, text follows a bare call) stays in the stream while parse_calls reads the text as content:
# `diverged` says so (logged).

_OPEN, _CLOSE, _PYTHON = "<tool_call>", "</tool_call>", "<|python_tag|>"
_JSON_WS = " \t\n\r"
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_HEX = frozenset("0123456789abcdefABCDEF")
_SCALAR_CHARS = frozenset("0123456789+-.eEtrufalsnNIiy")  # numbers, true, false, null, NaN, Infinity
_SCALAR = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][-+]?\d+)?|true|false|null|NaN|-?Infinity")


class _Bad(Exception):
    """Not JSON that json.loads takes."""


class _String:
    """A JSON string after its opening quote, decoded as json.loads decodes it (escapes; a
    \\uD83D\\uDE00 surrogate pair is one character), one character at a time."""

    def __init__(self):
        self.escape = ""  # an escape being read: "\\", "\\u", "\\u00", ...
        self.high: int | None = None  # a \\u high surrogate that a \\u low one may follow
        self.closed = False

    def feed(self, ch: str) -> str:
        """-> the characters decided by this one (often "", two when a lone surrogate resolves)."""
        if self.escape:
            self.escape += ch
            if len(self.escape) == 2:
                if ch == "u":
                    return ""
                if ch not in _ESCAPES:
                    raise _Bad
                self.escape = ""
                return self._held() + _ESCAPES[ch]
            if ch not in _HEX:
                raise _Bad
            if len(self.escape) < 6:
                return ""
            code, self.escape = int(self.escape[2:], 16), ""
            return self._code(code)
        if ch == "\\":
            self.escape = ch
            return ""
        if ch == '"':
            self.closed = True
            return self._held()
        if ord(ch) < 0x20:  # json.loads (strict) takes no raw control characters in a string
            raise _Bad
        return self._held() + ch

    def _held(self) -> str:
        out = "" if self.high is None else chr(self.high)
        self.high = None
        return out

    def _code(self, code: int) -> str:
        if self.high is not None and 0xDC00 <= code <= 0xDFFF:
            pair = 0x10000 + ((self.high - 0xD800) << 10 | (code - 0xDC00))
            self.high = None
            return chr(pair)
        out = self._held()
        if 0xD800 <= code <= 0xDBFF:
            self.high = code
            return out
        return out + chr(code)


class _Json:
    """A JSON object read a character at a time from its "{", checked as json.loads checks it
    (_Bad: not JSON) and written as json.dumps(json.loads(it), ensure_ascii=False) writes it, as far
    as it is read (`out`). `members`: each root key (its first time) -> [start, end] of its value in
    `out` (None until the value begins / while it is being read)."""

    def __init__(self):
        self.out = ""
        self.stack: list[str] = []  # the open containers, "{" or "["
        self.want = "value"  # next: "value", "value]" (or "]"), "key", "key}" (or "}"), ":", ",end"
        self.string: _String | None = None
        self.key: str | None = None  # a root key being read
        self.scalar = ""  # a number or literal being read
        self.members: dict[str, list] = {}
        self.member: list | None = None  # the root member whose value comes next / is being read
        self.done = False

    def feed(self, ch: str) -> None:
        if self.done:
            raise _Bad
        if self.string is not None:
            chars = self.string.feed(ch)
            if chars:
                self.out += json.dumps(chars, ensure_ascii=False)[1:-1]  # escaped one character at a time
                if self.key is not None:
                    self.key += chars
            if self.string.closed:
                self.out += '"'
                self.string = None
                if self.want != ":":
                    self._value_end()
                elif self.key is not None:  # a root key: its value comes next
                    self.member = None if self.key in self.members else self.members.setdefault(self.key, [None, None])
                    self.key = None
            return
        if self.scalar:
            if ch in _SCALAR_CHARS:
                self.scalar += ch
                return
            if not _SCALAR.fullmatch(self.scalar):
                raise _Bad
            self.out += json.dumps(json.loads(self.scalar))  # 1.50 -> 1.5, 1E2 -> 100.0, -0 -> 0
            self.scalar = ""
            self._value_end()
        if ch in _JSON_WS:
            return
        want = self.want
        if want in ("value", "value]"):
            if want == "value]" and ch == "]":
                self._close()
            else:
                self._value_start(ch)
        elif want in ("key", "key}"):
            if want == "key}" and ch == "}":
                self._close()
            elif ch == '"':
                self.string, self.want = _String(), ":"
                self.out += '"'
                if len(self.stack) == 1:
                    self.key = ""
            else:
                raise _Bad
        elif want == ":":
            if ch != ":":
                raise _Bad
            self.out += ": "
            self.want = "value"
        elif ch == ",":
            self.out += ", "
            self.want = "key" if self.stack[-1] == "{" else "value"
        elif ch == ("}" if self.stack[-1] == "{" else "]"):
            self._close()
        else:
            raise _Bad

    def _value_start(self, ch: str) -> None:
        if not self.stack and ch != "{":
            raise _Bad
        if len(self.stack) == 1 and self.member is not None:
            self.member[0] = len(self.out)
        if ch in "{[":
            self.stack.append(ch)
            self.out += ch
            self.want = "key}" if ch == "{" else "value]"
        elif ch == '"':
            self.string = _String()
            self.out += '"'
        elif ch in "-0123456789tfnNI":
            self.scalar = ch
        else:
            raise _Bad

    def _close(self) -> None:
        self.out += "}" if self.stack.pop() == "{" else "]"
        self._value_end()

    def _value_end(self) -> None:
        if not self.stack:
            self.done, self.want = True, "done"
            return
        if len(self.stack) == 1 and self.member is not None:
            self.member[1] = len(self.out)
            self.member = None
        self.want = ",end"


class _CallReader:
    """One call {"name": ..., "arguments": {...}} read a character at a time from its "{": `ok`
    turns False as soon as it cannot be a call parse_calls takes (_call), `name` is set once it is
    an allowed one, arguments() is the text parse_calls writes for them, as far as it is read.
    `index`: its place in the stream's calls once sent."""

    def __init__(self, names: frozenset[str]):
        self.json = _Json()
        self.names = names
        self.ok = True
        self.name: str | None = None
        self.key: str | None = None  # "arguments" or "parameters", whichever comes first
        self.parsed: str | None = None  # arguments given as a JSON string: their text, once read
        self.index: int | None = None

    @property
    def done(self) -> bool:
        return self.json.done

    @property
    def ready(self) -> bool:
        return self.ok and self.name is not None and self.arguments() is not None

    def feed(self, ch: str) -> None:
        try:
            self.json.feed(ch)
        except _Bad:
            self.ok = False
            return
        members, out = self.json.members, self.json.out
        if self.name is None and members.get("name", [None])[0] is not None:
            start, end = members["name"]
            value = out[start:end] if end is not None else out[start:]  # '"get_wea' ... '"get_weather"'
            if not value.startswith('"'):
                self.ok = False
            elif end is None:
                self.ok = any(n.startswith(value[1:]) for n in self.names)
            elif json.loads(value) in self.names:
                self.name = json.loads(value)
            else:
                self.ok = False
        if self.key is None:
            self.key = next((k for k in ("arguments", "parameters") if k in members), None)
        if self.key is not None and self.parsed is None:
            start, end = members[self.key]
            if start is not None and out[start] == '"':
                if end is not None:  # arguments as JSON text: a JSON object inside
                    args = _json(json.loads(out[start:end]))
                    if isinstance(args, dict):
                        self.parsed = json.dumps(args, ensure_ascii=False)
                    else:
                        self.ok = False
            elif start is not None and out[start] != "{":
                self.ok = False
        if self.done and self.name is None:
            self.ok = False

    def arguments(self) -> str | None:
        """The arguments' JSON text so far; None: nothing of them to send yet."""
        if self.key is None:
            return "{}" if self.done else None
        start, end = self.json.members[self.key]
        if start is None:
            return None
        if self.json.out[start] == '"':
            return self.parsed
        return self.json.out[start:end] if end is not None else self.json.out[start:]


@dataclasses.dataclass
class _Block:
    """A <tool_call> block in the text: its raw text, the closing tag's prefix held, and where it
    is: "lead" (whitespace before the JSON), "json", "tail" (whitespace after it) or "skip" (not a
    call: content up to the closing tag)."""

    raw: str = _OPEN
    close: str = ""
    phase: str = "lead"
    reader: _CallReader | None = None


class ToolCallStream:
    """parse_calls for an answer that comes in pieces. feed(text) -> the OpenAI stream deltas the
    text so far decides, finish() -> the rest; joined, the content and each call's arguments are
    what parse_calls(the whole text) returns (`final` after finish; ids aside):

      {"content": "..."}
      {"tool_calls": [{"index": i, "id": "call_...", "type": "function",
                       "function": {"name": "get_weather", "arguments": ""}}]}    once per call, then
      {"tool_calls": [{"index": i, "function": {"arguments": '{"city": "Pa'}}]}  as its JSON grows
    """

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.names = frozenset(plan.allowed or [f.name for f in plan.functions])
        self.text = ""  # everything fed
        self.read = 0  # how much of it has been read
        self.mode = "start" if plan.renders else "plain"
        self.lead = ""  # start: a <|python_tag|> (or its prefix) after the leading whitespace
        self.bare = ""  # bare: "{" (the object), "[" (a list: an element next), "[{" (an element), "[," (after one), "end"
        self.readers: list[_CallReader] = []  # bare: its calls
        self.tag = ""  # text: a "<tool_call>" prefix, held
        self.block: _Block | None = None
        self.space = ""  # whitespace not yet content
        self.begun = False  # some content read
        self.found = 0  # text: complete calls
        self.pending: list[str] = []  # content read, not yet sent
        self.calls: list[list] = []  # [reader, id, characters of its arguments sent (-1: its header not yet)]
        self.sent: list[str] = []  # the content sent
        self.final: tuple[str | None, list[dict]] | None = None
        self.diverged = False

    def feed(self, text: str) -> list[dict]:
        self._read(text)
        return self._flush()

    def finish(self, text: str = "") -> list[dict]:
        """The answer ends with `text`: what the text still held decides (and parse_calls checks)."""
        self._read(text)
        if self.mode == "start" or (self.mode == "bare" and self.bare != "end"):
            self._again()
        if self.mode == "text":
            held, self.tag = self.tag, ""
            for ch in held:
                self._content(ch)
            if self.block is not None:  # unterminated: the last call may end at the stop token
                held, self.block.close = self.block.close, ""
                for ch in held:
                    self._inner(ch)
                self._end_block(closed=False)
            if not self.found:
                self.pending.append(self.space)
        out = self._flush()
        self.final = content, calls = parse_calls(self.text, self.plan)
        sent = [(r.name, r.arguments()) for r, _, _ in self.calls]
        if "".join(self.sent) != (content or "") or sent != [(c["function"]["name"], c["function"]["arguments"])
                                                               for c in calls]:
            self.diverged = True
            log.info("tools: the streamed answer differs from its parse (%d calls sent, %d parsed): a call was cut "
                     "short or stopped being one after it was sent", len(sent), len(calls))
        return out

    # ---- reading --------------------------------------------------------------------------
    def _read(self, text: str) -> None:
        self.text += text
        for ch in text:
            self.read += 1
            self._char(ch)

    def _char(self, ch: str) -> None:
        if self.mode == "text":
            self._text(ch)
        elif self.mode == "plain":
            self.pending.append(ch)
        elif self.mode == "start":
            self._start(ch)
        else:
            self._bare(ch)

    def _start(self, ch: str) -> None:
        if ch.isspace() and self.lead in ("", _PYTHON):
            return
        if ch in "{[" and self.lead in ("", _PYTHON):
            self.mode, self.bare = "bare", ch
            if ch == "{":
                self._reader(ch)
            return
        self.lead += ch
        if not _PYTHON.startswith(self.lead):
            self._again()

    def _bare(self, ch: str) -> None:
        if self.bare in ("{", "[{"):
            r = self.readers[-1]
            r.feed(ch)
            if not r.ok:
                return self._again()
            self._send(r)
            if r.done:
                self.bare = "end" if self.bare == "{" else "[,"
        elif self.bare == "end":
            if not ch.isspace():
                self._again()
        elif ch in _JSON_WS:
            return
        elif self.bare == "[" and ch == "{":
            self.bare = "[{"
            self._reader(ch)
        elif self.bare == "[," and ch in ",]":
            self.bare = "[" if ch == "," else "end"
        else:  # an empty list, a trailing comma, an element that is not an object: no calls
            self._again()

    def _reader(self, ch: str) -> None:
        r = _CallReader(self.names)
        r.feed(ch)
        self.readers.append(r)

    def _again(self) -> None:
        """Not a bare call after all: read the text so far again, as text."""
        for r in self.readers:
            self._drop(r)
        self.readers, self.mode = [], "text"
        for ch in self.text[:self.read]:
            self._text(ch)

    def _text(self, ch: str) -> None:
        if self.block is not None:
            return self._block(ch)
        self.tag += ch
        if _OPEN.startswith(self.tag):
            if self.tag == _OPEN:
                self.tag, self.block = "", _Block()
            return
        held, self.tag = self.tag, ""
        self._content(held[0])
        for c in held[1:]:
            self._text(c)

    def _block(self, ch: str) -> None:
        b = self.block
        b.close += ch
        if _CLOSE.startswith(b.close):
            if b.close == _CLOSE:
                self._end_block(closed=True)
            return
        held, b.close = b.close, ""
        self._inner(held[0])
        for c in held[1:]:
            self._block(c)

    def _inner(self, ch: str) -> None:
        """A character inside a block (not part of its closing tag)."""
        b = self.block
        b.raw += ch
        if b.phase == "skip":
            return self._content(ch)
        if b.phase == "lead":
            if ch.isspace():
                return
            if ch != "{":
                return self._not_a_call(b)
            b.phase, b.reader = "json", _CallReader(self.names)
        if b.phase == "json":
            b.reader.feed(ch)
            if not b.reader.ok:
                return self._not_a_call(b)
            self._send(b.reader)
            if b.reader.done:
                b.phase = "tail"
        elif not ch.isspace():  # tail: text after the call's JSON inside its block
            self._not_a_call(b)

    def _end_block(self, closed: bool) -> None:
        b, self.block = self.block, None
        if b.phase == "tail":
            self.found += 1
            return
        if b.phase != "skip":  # nothing or unfinished JSON before the end
            self._not_a_call(b)
        for ch in _CLOSE if closed else "":
            self._content(ch)

    def _not_a_call(self, b: _Block) -> None:
        if b.reader is not None:
            self._drop(b.reader)
        b.phase = "skip"
        for ch in b.raw:
            self._content(ch)

    def _content(self, ch: str) -> None:
        if ch.isspace():
            self.space += ch
            return
        if self.begun or not self.found:  # leading whitespace is content unless a call came first
            self.pending.append(self.space)
        self.pending.append(ch)
        self.space, self.begun = "", True

    # ---- sending --------------------------------------------------------------------------
    def _send(self, r: _CallReader) -> None:
        """A call goes out (at the next flush) once its name and the start of its arguments are read."""
        if r.index is None and r.ready:
            r.index = len(self.calls)
            self.calls.append([r, call_id(), -1])

    def _drop(self, r: _CallReader) -> None:
        """Not a call: unsent, it is forgotten (a sent one stays sent)."""
        if r.index is not None and r.index < len(self.calls) and self.calls[r.index][2] < 0:
            del self.calls[r.index:]  # the calls after it are unsent too

    def _flush(self) -> list[dict]:
        out = []
        content = "".join(self.pending)
        self.pending = []
        if content:
            out.append({"content": content})
            self.sent.append(content)
        for i, call in enumerate(self.calls):
            r, id_, sent = call
            if sent < 0:
                out.append({"tool_calls": [{"index": i, "id": id_, "type": "function",
                                            "function": {"name": r.name, "arguments": ""}}]})
                sent = 0
            args = r.arguments() or ""
            if len(args) > sent:
                out.append({"tool_calls": [{"index": i, "function": {"arguments": args[sent:]}}]})
            call[2] = max(sent, len(args))
        return out
