"""Tool calls read as the answer streams: ToolCallStream says what gateway/tools.py's parse_calls
will say of an answer as soon as the text so far decides it, as OpenAI stream deltas (content at
once, each call as a header then its arguments in pieces that join to parse_calls' arguments)."""
from __future__ import annotations

import dataclasses
import json
import logging
import re

from specsplit.gateway.tools import ToolPlan, arguments_text, call_id, parse_calls

log = logging.getLogger(__name__)

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
# be a call. When a call goes out is the server's choice (--tool-call-stream):
#
#   decided  (the default) once nothing after it can change what parse_calls says of it: a
#            <tool_call> block when its closing tag comes (or the answer ends after its JSON), a bare
#            call when the answer ends. The call's header and all its arguments then go out
#            together, and the joined stream is always parse_calls' answer (`diverged` stays False).
#   eager    as soon as its name is an allowed one and its arguments have begun, its arguments then
#            in pieces as they grow. What was sent is never taken back, so a call whose text then
#            stops being one (max_tokens cuts it, its JSON breaks, text follows a bare call) stays
#            in the stream while parse_calls reads the text as content: `diverged` says so (logged).

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
        self.decided = False  # nothing after it can make it content (its block closed, or the answer ended)

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
                    self.parsed = arguments_text(json.loads(out[start:end]))
                    if self.parsed is None:
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
      {"tool_calls": [{"index": i, "function": {"arguments": '{"city": "Pa'}}]}  its arguments: whole
                                                  once the call is decided, or in pieces (mode "eager")
    """

    MODES = ("decided", "eager")  # --tool-call-stream; see the comment above _OPEN

    def __init__(self, plan: ToolPlan, mode: str = "decided"):
        if mode not in self.MODES:
            raise ValueError(f"tool-call stream mode {mode!r}: one of {', '.join(self.MODES)}")
        self.plan = plan
        self.eager = mode == "eager"
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
        if self.mode == "bare":  # the answer ends after its calls: they are calls
            for r in self.readers:
                self._decide(r)
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
            self._decide(b.reader)
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
        """A call goes out (at the next flush) once its name and the start of its arguments are read
        (eager), or once it is decided."""
        if r.index is None and r.ready and (self.eager or r.decided):
            r.index = len(self.calls)
            self.calls.append([r, call_id(), -1])

    def _decide(self, r: _CallReader) -> None:
        r.decided = True
        self._send(r)

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
