"""gateway/tool_stream.py ToolCallStream: parse_calls for an answer that comes in pieces. Every accepted
form (bare JSON object or list, <|python_tag|>, <tool_call> blocks, closed or cut at the stop
token) and the texts that are not calls, fed whole, character by character and in seeded random
pieces: the content deltas joined and each call's arguments fragments joined equal parse_calls'
content and calls (ids aside), each call's first delta is its header (id, type, name, arguments
""), and the stream says what it can as early as the text decides it. The real server:
tests/e2e/test_smollm_tools.py."""
from __future__ import annotations

import json
import random

import pytest

from specsplit.gateway.tool_stream import ToolCallStream
from specsplit.gateway.tools import parse_calls, plan_tools

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}
AUTO = plan_tools([WEATHER, TIME], "auto")

CALLS = [  # parse_calls finds calls in each
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    '  \n{"name":"get_weather","arguments":{"city":"Paris"}}  \n',
    '<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}',
    ' <|python_tag|> [{"name": "get_weather", "arguments": {"city": "Oslo"}} ,\n{"name": "get_time", "arguments": {}}]',
    '{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}',  # arguments as JSON text
    '{"arguments": {"city": "Rome"}, "name": "get_weather", "extra": [1, 2]}',  # the name last
    '{"name": "get_time"}',  # no arguments: {}
    '{"name":"get_weather","arguments":{"city":"Z\\u00fcrich \\ud83d\\ude00 \\ud83d x","n":1.50,"e":1E2,"neg":-0,'
    '"big":12345678901234567890,"ok":true,"no":false,"none":null,"nan":NaN,"inf":-Infinity,"list":[1, [2,{}], []],'
    '"esc":"a\\"b\\\\c\\/d\\n\\t\\u0001","nested":{"a":{"b":"c"}}}}',
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
    '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}',  # the last cut at the stop token
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n',
    '<tool_call>{"arguments": {"city": "Rome"}, "name": "get_weather"}</tool_call>',
    '<tool_call>{"name": "get_time"}</tool_call>\n\nDone. ',
    ' Sure. <tool_call>{"name": "get_time", "arguments": {}}</tool_call> \n And done.\n',
    '\u3000<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
    '<<tool_call>{"name": "get_time", "arguments": {"zone": "a</tool_callb"}}</tool_call>',
    '<tool_call>{"name": "nope", "arguments": {}}</tool_call> then <tool_call>{"name": "get_time"}</tool_call>',
    'a <tool_call>junk <tool_call>{"name": "get_time", "arguments": {}}</tool_call> b'
    '<tool_call>{"name": "get_weather", "arguments": {"city": "<tool_call>"}}</tool_call>',
]
CONTENT = [  # parse_calls finds none: all content
    "The weather in Paris is sunny.\n\nHave a nice day! ",
    "  Hello <b>there</b> <tool_ and <tool_call",
    "x </tool_call> y",
    "",
    "  \n",
    '{"answer": 42, "name": "John"}',
    '{"name": "get_weather", "arguments": [1]}',
    '{"name": "get_weather", "arguments": "not json"}',
    "[1, 2]",
    "[]",
    "{not json",
    "<|python_tag|>hello",
    "<|python_tag|><tool_call>{broken</tool_call>",
    '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
    "<tool_call>{broken</tool_call>",
    "<tool_call></tool_call> x",
    "<tool_call>[1]</tool_call>",
    '<tool_call>{"name": "get_tim", "arguments": {}}</tool_call>',
]
BROKEN = [  # no calls either, but only known after a call's name and arguments began: a cut call and
    # calls whose JSON breaks later ('[{...},]', a raw control character, 01, text after it, its block
    # closed inside it)
    '<tool_call>{"name": "get_weather", "arguments": {"ci',
    '{"name": "get_time", "arguments": {}} no',
    '[{"name": "get_time"},]',
    '<tool_call>{"name": "get_time"} trailing</tool_call>',
    '<tool_call>{"name": "get_time", "arguments": {"zone": "a</tool_call>"}}</tool_call>',
    '<tool_call>{"name": "get_time", "arguments": {"zone": "\x01"}}</tool_call>',
    '<tool_call>{"name": "get_time", "arguments": {"n": 01}}</tool_call>',
]


def _pieces(text: str, how: str, rng: random.Random) -> list[str]:
    if how == "whole":
        return [text]
    if how == "chars":
        return list(text)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def _stream(text: str, plan, pieces: list[str], mode: str = "decided"):
    """-> (the stream, its deltas per piece (the last piece: finish()'s), content joined, [(name, arguments)] joined)."""
    s = ToolCallStream(plan, mode)
    per_piece = [s.feed(p) for p in pieces[:-1]] + [s.finish(pieces[-1] if pieces else "")]
    content, calls = "", {}
    for d in (d for ds in per_piece for d in ds):
        content += d.get("content", "")
        for tc in d.get("tool_calls", ()):
            i = tc["index"]
            if i not in calls:  # the header first: index, id, type, name and arguments ""
                assert i == len(calls) and tc["id"].startswith("call_") and tc["type"] == "function", tc
                assert tc["function"]["arguments"] == "" and tc["function"]["name"], tc
                calls[i] = [tc["function"]["name"], ""]
            else:
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}, tc
                calls[i][1] += tc["function"]["arguments"]
    return s, per_piece, content, [tuple(c) for c in calls.values()]


def _expected(text: str, plan):
    content, calls = parse_calls(text, plan)
    return content or "", [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


@pytest.mark.parametrize("mode", ToolCallStream.MODES)
@pytest.mark.parametrize("how", ["whole", "chars", "random"])
@pytest.mark.parametrize("text", CALLS + CONTENT)
def test_every_split_streams_what_parse_calls_returns(text, how, mode):
    rng = random.Random(len(text))
    want = _expected(text, AUTO)
    assert bool(want[1]) == (text in CALLS), want
    for _ in range(20 if how == "random" else 1):
        pieces = _pieces(text, how, rng)
        s, _, content, calls = _stream(text, AUTO, pieces, mode)
        assert (content, calls) == want and not s.diverged, pieces


def _random_value(rng: random.Random, depth: int = 0):
    kind = rng.choice(["str", "int", "float", "bool", "null"] + (["list", "dict"] if depth < 3 else []))
    if kind == "str":
        return "".join(rng.choice('ab "\\/\n\t\x07é€😀<>_') for _ in range(rng.randint(0, 8)))
    if kind == "int":
        return rng.randint(-10**20, 10**20)
    if kind == "float":
        return rng.choice([0.5, -0.0, 1e-7, 3.14159, 1e300, float(rng.randint(-99, 99))])
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "list":
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {f"k{i}{rng.choice('ab<')}": _random_value(rng, depth + 1) for i in range(rng.randint(0, 4))}


def test_random_arguments_in_every_json_spelling():
    """Arguments written as json.dumps writes them with any indent, separators and ensure_ascii:
    the stream's fragments join to parse_calls' canonical text (json.dumps, ensure_ascii=False)."""
    rng = random.Random(25)
    for n in range(150):
        args = _random_value(rng, 1) if n % 5 else {}
        args = args if isinstance(args, dict) else {"v": args}
        spell = dict(indent=rng.choice([None, 0, 2]), ensure_ascii=rng.random() < 0.5,
                     separators=rng.choice([None, (",", ":"), (" , ", " : ")]))
        call = json.dumps({"name": rng.choice(["get_weather", "get_time"]), "arguments": args}, **spell)
        text = rng.choice(["{}", "<tool_call>\n{}\n</tool_call>", "Hi.\n<tool_call>{}", "[{}]"]).format(call)
        want = _expected(text, AUTO)
        assert want[1], text
        for how in ("chars", "random"):
            for mode in ToolCallStream.MODES:
                s, _, content, calls = _stream(text, AUTO, _pieces(text, how, rng), mode)
                assert (content, calls) == want and not s.diverged, (text, mode)


def _sent_before_finish(per_piece) -> list[dict]:
    return [d for ds in per_piece[:-1] for d in ds]


def test_eager_a_call_streams_its_header_then_its_arguments_as_they_grow():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo, Norway"}}\n</tool_call>'
    _, per_piece, _, _ = _stream(text, AUTO, list(text), "eager")
    early = _sent_before_finish(per_piece)
    first_call = next(j for j, d in enumerate(early) if "tool_calls" in d)
    assert "".join(d.get("content", "") for d in early[:first_call]) == "Let me check."  # before the call began
    fragments = [tc["function"]["arguments"] for d in early for tc in d.get("tool_calls", ())]
    assert fragments[0] == "" and len(fragments) > 10  # the header, then a piece per character or so
    assert "".join(fragments) == '{"city": "Oslo, Norway"}'
    # the header went out once the name and the start of the arguments were read, not at the end
    k = next(j for j, ds in enumerate(per_piece) if any("tool_calls" in d for d in ds))
    assert text[:k + 1].endswith('"arguments": {')


def test_content_streams_as_it_comes_even_with_tools():
    text = "The weather in Paris is sunny, I think."
    _, per_piece, _, _ = _stream(text, AUTO, list(text))
    for j, ch in enumerate(text):
        if ch.isspace():
            assert per_piece[j] == []  # held: it is not content if a call ends the answer
        else:  # nothing else held
            assert per_piece[j] == [{"content": (" " if text[j - 1] == " " else "") + ch}], (j, per_piece[j])
    # what looked like a call and was not is content as soon as that is known: here at "J"
    text = '{"name": "John", "age": 3}'
    _, per_piece, _, _ = _stream(text, AUTO, list(text))
    assert per_piece[:10] == [[]] * 10 and per_piece[10] == [{"content": '{"name": "J'}]


def test_tool_choice_none_and_a_named_function():
    call = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    for plan, text in ((plan_tools([WEATHER], "none"), call),
                       (plan_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}), call),
                       (plan_tools([WEATHER, TIME], "required"), call)):
        for how in ("whole", "chars"):
            for mode in ToolCallStream.MODES:
                s, _, content, calls = _stream(text, plan, _pieces(text, how, random.Random(0)), mode)
                assert (content, calls) == _expected(text, plan) and not s.diverged


@pytest.mark.parametrize("text", BROKEN)
def test_eager_sent_is_never_taken_back(text):
    """Eager: a call whose text stops being one after its header went out (max_tokens cut it, its
    JSON broke, text after a bare call) stays sent; the content follows parse_calls and the stream
    says it diverged. Fed whole (or cut in the last piece) nothing was sent early: no divergence."""
    s, _, content, calls = _stream(text, AUTO, list(text), "eager")
    assert s.diverged and parse_calls(text, AUTO) == (text, []) and content == text
    assert [name for name, _ in calls] == ["get_weather" if "weather" in text else "get_time"]
    s, _, content, calls = _stream(text, AUTO, [text], "eager")
    assert not s.diverged and (content, calls) == (text, [])


@pytest.mark.parametrize("how", ["whole", "chars", "random"])
@pytest.mark.parametrize("text", BROKEN)
def test_decided_a_broken_call_is_never_sent(text, how):
    """Decided (the default): the texts that looked like a call and stopped being one are content,
    streamed as parse_calls reads them, with no call sent at any point."""
    rng = random.Random(len(text))
    for _ in range(10 if how == "random" else 1):
        s, per_piece, content, calls = _stream(text, AUTO, _pieces(text, how, rng))
        assert not s.diverged and (content, calls) == (text, []) == parse_calls(text, AUTO)
        assert not any("tool_calls" in d for ds in per_piece for d in ds)


def test_decided_a_block_goes_out_whole_at_its_closing_tag():
    call = '{"name": "get_weather", "arguments": {"city": "Oslo, Norway"}}'
    text = f"Let me check.\n<tool_call>\n{call}\n</tool_call>\n<tool_call>{call}"
    _, per_piece, content, calls = _stream(text, AUTO, list(text))
    first = text.index("</tool_call>") + len("</tool_call>") - 1  # the piece that closes the first block
    assert not any("tool_calls" in d for ds in per_piece[:first] for d in ds)
    assert per_piece[first][0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert per_piece[first][1] == {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Oslo, Norway"}'}}]}
    # the second block is never closed: the answer's end decides it (finish), also whole
    assert not any("tool_calls" in d for ds in per_piece[first + 1:-1] for d in ds)
    assert [tc["tool_calls"][0]["index"] for tc in per_piece[-1] if "tool_calls" in tc] == [1, 1]
    assert content == "Let me check." and calls == [("get_weather", '{"city": "Oslo, Norway"}')] * 2


def test_decided_bare_calls_wait_for_the_end():
    text = '[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_time", "arguments": {}}]'
    _, per_piece, content, calls = _stream(text, AUTO, list(text))
    assert all(ds == [] for ds in per_piece[:-1])  # text after it would make it content: held to the end
    assert content == "" and calls == [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")]
