"""gateway/http_api.py against a scripted scheduler (no model): the exact SSE bytes, the mapping of
Event.logprobs to OpenAI's completions and chat shapes, what a request becomes (GenerationRequest
fields, OpenAI's defaults), and errors raised mid-stream. The real server: tests/services/test_services_http.py."""
from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from tests.helpers.http_app import serving
from specsplit.gateway.service import GatewayServicer
from specsplit.request import Event, Limits, RequestError, TokenLogprob

openai = pytest.importorskip("openai")

MODEL = "tiny"


class _Tok:
    """Token i is the word "w<i>"; a chat turn is its role's word, then its words."""

    def decode(self, ids):
        return " ".join(f"w{i}" for i in ids)

    def token_bytes(self, token_id):
        return self.decode([token_id]).encode()


class _Scheduler:
    """Emits each request's script: OUTPUT tokens in events of two, logprobs when asked; the
    last one, 9, is the end-of-sequence token when `finish` is "stop"."""

    OUTPUT = [5, 6, 7, 8, 9]

    inflight = 0

    def __init__(self):
        self.requests, self.aborted = [], []
        self.fail_after: int | None = None
        self.finish = "length"
        self.scheduler = type("Core", (), {"eos_token_ids": (9,)})()

    def submit(self, req, sink):
        self.requests.append(req)
        threading.Thread(target=self._run, args=(req, sink), daemon=True).start()
        return req

    def _run(self, req, sink):
        out = self.OUTPUT[: req.max_tokens]
        prompt = None  # prompt_logprobs: token t after the first scores -t / 100, rank t, with n alternatives
        if req.prompt_logprobs is not None:
            prompt = [TokenLogprob(t, -t / 100, tuple((t + j, -(t + j) / 100) for j in range(req.prompt_logprobs)), t)
                      for t in req.prompt_token_ids[1:]]
        if not out:  # max_tokens 0: the prompt scored, nothing generated
            sink(Event([], "", "length", {"prompt_tokens": len(req.prompt_token_ids), "completion_tokens": 0},
                       prompt_logprobs=prompt))
            return
        for i in range(0, len(out), 2):
            time.sleep(0.01)
            if self.fail_after is not None and i >= self.fail_after:
                sink(Event(error=RequestError(RequestError.UNAVAILABLE, "the verifier does not answer")))
                return
            ids = out[i:i + 2]
            last = i + 2 >= len(out)
            lps = None
            if req.logprobs is not None:
                lps = [TokenLogprob(t, -0.5 * t / 10, tuple((t + j, -0.5 * (t + j) / 10) for j in range(req.logprobs)))
                       for t in ids]
            words = ids[:-1] if last and self.finish == "stop" else ids  # Request: EOS's text is not text
            text = " ".join(f"w{t}" for t in words) + ("" if last else " ")
            usage = {"prompt_tokens": len(req.prompt_token_ids), "completion_tokens": len(out)} if last else None
            sink(Event(ids, text, self.finish if last else None, usage, logprobs=lps,
                       prompt_logprobs=prompt if i == 0 else None))

    def abort(self, request, reason="cancelled"):
        self.aborted.append(request)


class _Servicer(GatewayServicer):
    """The real servicer (its submit path: draining, checks, admission, build_request) over the
    scripted scheduler, with a tokenizer that reads "w<i>" words."""

    def __init__(self):
        super().__init__(_Scheduler(), _Tok(), Limits(vocab_size=256, max_model_len=64), None)

    async def prompt_ids(self, msg):
        self.tokenized = msg  # the GenerateRequest the servicer's Tokenizer would render
        if msg.prompt_token_ids:
            return list(msg.prompt_token_ids)
        if msg.prompt:
            return [int(w[1:]) for w in msg.prompt.split()]
        return [t for m in msg.messages for t in [2, *(int(w[1:]) for w in m.content.split())]] + [3]

    async def admit(self, req):  # no tokenizer here: grammars are compiled by the real servicer
        self.admitted = req


@pytest.fixture(scope="module")
def server():
    servicer = _Servicer()
    with serving(servicer, MODEL) as http:
        yield servicer, http


def _client(http):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{http.port}/v1", api_key="x", max_retries=0, timeout=10)


def _post(http, path: str, body: dict) -> urllib.request.Request:
    return urllib.request.Request(f"http://127.0.0.1:{http.port}{path}", data=json.dumps(body).encode(),
                                  headers={"Content-Type": "application/json"})


def _post_raw(http, path: str, body: dict) -> bytes:
    with urllib.request.urlopen(_post(http, path, body), timeout=10) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        return r.read()


def _post_json(http, path: str, body: dict) -> dict:
    """The JSON answer as sent (the openai client drops fields it does not model)."""
    with urllib.request.urlopen(_post(http, path, body), timeout=10) as r:
        return json.loads(r.read())


def test_defaults_follow_openai(server):
    servicer, http = server
    _client(http).completions.create(model=MODEL, prompt="w1 w2")
    req = servicer.scheduler.requests[-1]
    assert req.max_tokens == 16 and req.params.temperature == 1.0 and req.params.top_p == 1.0
    assert req.params.seed is None and req.logprobs is None and req.prompt_token_ids == (1, 2)
    _client(http).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w4"}], seed=-1,
                                          temperature=0.7, top_p=0.9, stop="w9", extra_body={"top_k": 5})
    req = servicer.scheduler.requests[-1]
    assert req.prompt_token_ids == (2, 4, 3) and req.max_tokens == 64 - 3  # chat: the rest of the context
    assert (req.params.temperature, req.params.top_p, req.params.top_k) == (0.7, 0.9, 5)
    assert req.params.seed == 2**64 - 1 and req.stop == ("w9",)


def test_sse_bytes_are_openai_s(server):
    _, http = server
    raw = _post_raw(http, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "w1"}],
                                                    "max_tokens": 3, "stream": True,
                                                    "stream_options": {"include_usage": True}})
    frames = raw.split(b"\n\n")
    assert frames[-1] == b"" and frames[-2] == b"data: [DONE]"
    chunks = [json.loads(f[len(b"data: "):]) for f in frames[:-2]]
    assert all(f.startswith(b"data: ") for f in frames[:-1])
    assert [c["choices"][0]["delta"] if c["choices"] else None for c in chunks] == [
        {"role": "assistant", "content": ""}, {"content": "w5 w6 "}, {"content": "w7"}, {}, None]
    assert [c["choices"][0]["finish_reason"] if c["choices"] else "-" for c in chunks] == [None, None, None, "length", "-"]
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == MODEL for c in chunks)
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}


def test_completion_logprobs_shape(server):
    _, http = server
    res = _client(http).completions.create(model=MODEL, prompt="w1", max_tokens=3, logprobs=2)
    lp = res.choices[0].logprobs
    assert lp.tokens == ["w5", "w6", "w7"]
    assert lp.token_logprobs == [-0.25, -0.3, -0.35]
    assert lp.top_logprobs == [{"w5": -0.25, "w6": -0.3}, {"w6": -0.3, "w7": -0.35}, {"w7": -0.35, "w8": -0.4}]
    # the server's incremental decode of "w5 w6 w7": a token's text starts with the space before it
    assert lp.text_offset == [0, 2, 5]
    streamed = list(_client(http).completions.create(model=MODEL, prompt="w1", max_tokens=3, logprobs=2, stream=True))
    assert [t for c in streamed for t in c.choices[0].logprobs.tokens] == lp.tokens
    assert [o for c in streamed for o in c.choices[0].logprobs.text_offset] == lp.text_offset


def test_echo_with_logprobs_has_the_prompt_first(server):
    """echo: the prompt's text then the completion's; its tokens first in logprobs, the first with
    null logprob and top_logprobs, text_offset from 0 in the prompt's text; max_tokens 0 scores only
    (what lm-eval's loglikelihood requests send); streamed, the first chunk holds the prompt."""
    servicer, http = server
    res = _client(http).completions.create(model=MODEL, prompt="w1 w2 w3", max_tokens=1, logprobs=1, echo=True)
    assert servicer.scheduler.requests[-1].prompt_logprobs == 1
    c = res.choices[0]
    assert c.text == "w1 w2 w3w5"
    lp = c.logprobs
    assert lp.tokens == ["w1", "w2", "w3", "w5"]
    assert lp.token_logprobs == [None, -0.02, -0.03, -0.25]
    assert lp.top_logprobs == [None, {"w2": -0.02}, {"w3": -0.03}, {"w5": -0.25}]
    assert lp.text_offset == [0, 2, 5, 8]  # the prompt's decoded text ("w1", " w2", " w3"); the completion after it
    res = _client(http).completions.create(model=MODEL, prompt=[4, 5], max_tokens=0, logprobs=0, echo=True)
    c = res.choices[0]
    assert c.text == "w4 w5" and c.finish_reason == "length" and res.usage.completion_tokens == 0
    assert c.logprobs.tokens == ["w4", "w5"] and c.logprobs.token_logprobs == [None, -0.05]
    assert c.logprobs.top_logprobs == [None, {}]
    streamed = list(_client(http).completions.create(model=MODEL, prompt="w1 w2 w3", max_tokens=1, logprobs=1,
                                                     echo=True, stream=True))
    assert "".join(x.choices[0].text for x in streamed) == "w1 w2 w3w5"
    assert [t for x in streamed for t in x.choices[0].logprobs.tokens] == ["w1", "w2", "w3", "w5"]
    res = _client(http).completions.create(model=MODEL, prompt="w1 w2", max_tokens=2, echo=True)
    assert res.choices[0].text == "w1 w2w5 w6" and res.choices[0].logprobs is None
    assert servicer.scheduler.requests[-1].prompt_logprobs is None  # no logprobs: the prompt is not scored


def test_max_tokens_0_needs_echo(server):
    _, http = server
    with pytest.raises(openai.BadRequestError) as e:
        _client(http).completions.create(model=MODEL, prompt="w1", max_tokens=0)
    assert e.value.body["param"] == "max_tokens" and "0 only with echo" in e.value.body["message"]


def test_n_choices_are_requests_of_their_own(server):
    """n = 3: three requests to the scheduler (seeds seed, seed + 1, seed + 2), three choices with
    their index, usage counting the prompt once and every choice's tokens; streamed, each chunk
    names its choice and every choice ends; n outside [1, 16] is a 400."""
    servicer, http = server
    before = len(servicer.scheduler.requests)
    res = _client(http).completions.create(model=MODEL, prompt="w1 w2", max_tokens=3, n=3, seed=41, logprobs=0)
    reqs = servicer.scheduler.requests[before:]
    assert [r.params.seed for r in reqs] == [41, 42, 43] and len({r.request_id for r in reqs}) == 3
    assert [c.index for c in res.choices] == [0, 1, 2] and all(c.text == "w5 w6 w7" for c in res.choices)
    assert all(c.logprobs.tokens == ["w5", "w6", "w7"] for c in res.choices)
    assert (res.usage.prompt_tokens, res.usage.completion_tokens) == (2, 9)
    res = _client(http).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w1"}],
                                                max_tokens=2, n=2)
    assert [c.index for c in res.choices] == [0, 1] and all(c.message.content == "w5 w6" for c in res.choices)
    assert res.usage.completion_tokens == 4
    chunks = list(_client(http).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w1"}],
                                                        max_tokens=3, n=2, stream=True,
                                                        stream_options={"include_usage": True}))
    for i in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert mine[0].delta.role == "assistant" and "".join(x.delta.content or "" for x in mine) == "w5 w6 w7"
        assert mine[-1].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 6
    for n in (0, 17):
        with pytest.raises(openai.BadRequestError) as e:
            _client(http).completions.create(model=MODEL, prompt="w1", max_tokens=1, n=n)
        assert e.value.body["param"] == "n" and "n must be in [1, 16]" in e.value.body["message"]


def test_chat_logprobs_shape(server):
    _, http = server
    res = _client(http).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w1"}],
                                                max_tokens=2, logprobs=True, top_logprobs=1)
    content = res.choices[0].logprobs.content
    assert [(c.token, c.logprob, c.bytes) for c in content] == [("w5", -0.25, [119, 53]), ("w6", -0.3, [119, 54])]
    assert [[(t.token, t.logprob) for t in c.top_logprobs] for c in content] == [[("w5", -0.25)], [("w6", -0.3)]]
    plain = _client(http).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w1"}], max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_an_error_before_any_token_is_a_status_and_mid_stream_an_error_event(server):
    servicer, http = server
    servicer.scheduler.fail_after = 0
    try:
        with pytest.raises(openai.InternalServerError) as err:
            _client(http).completions.create(model=MODEL, prompt="w1", max_tokens=5, stream=True)
        assert err.value.status_code == 503 and "verifier" in err.value.body["message"]
        servicer.scheduler.fail_after = 2
        raw = _post_raw(http, "/v1/completions", {"model": MODEL, "prompt": "w1", "max_tokens": 5, "stream": True})
        frames = raw.split(b"\n\n")
        assert json.loads(frames[-3][6:])["error"]["code"] == "service_unavailable"
        assert frames[-2] == b"data: [DONE]"
    finally:
        servicer.scheduler.fail_after = None


def test_draining_refuses_with_503(server):
    servicer, http = server
    servicer.draining = True
    try:
        with pytest.raises(openai.InternalServerError) as err:
            _client(http).completions.create(model=MODEL, prompt="w1", max_tokens=2)
        assert err.value.status_code == 503
        with urllib.request.urlopen(f"http://127.0.0.1:{http.port}/health", timeout=5) as r:
            pytest.fail(f"/health answered {r.status} while draining")
    except urllib.error.HTTPError as e:
        assert e.code == 503
    finally:
        servicer.draining = False


def test_a_body_over_max_request_bytes_is_413(server):
    _, http = server
    backend = http.app.state.backend
    backend.max_request_bytes = 200
    try:
        with pytest.raises(openai.APIStatusError) as err:
            _client(http).completions.create(model=MODEL, prompt="w1 " * 100, max_tokens=2)
        assert err.value.status_code == 413 and "--max-request-bytes" in err.value.body["message"]
        assert _client(http).completions.create(model=MODEL, prompt="w1", max_tokens=2).choices[0].text
    finally:
        backend.max_request_bytes = None


def test_penalties_logit_bias_and_response_format_become_the_request(server):
    servicer, http = server
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    _client(http).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "w4"}], presence_penalty=0.5, frequency_penalty=-1.5,
        logit_bias={"7": -100, "12": 3.5}, extra_body={"repetition_penalty": 1.2},
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    p = servicer.scheduler.requests[-1].params
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -1.5, 1.2)
    assert p.logit_bias == ((7, -100.0), (12, 3.5))
    assert p.grammar.kind == "json_schema" and json.loads(p.grammar.text) == schema
    _client(http).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w4"}],
                                          response_format={"type": "json_object"})
    assert servicer.scheduler.requests[-1].params.grammar.kind == "json_object"
    _client(http).completions.create(model=MODEL, prompt="w1", extra_body={"response_format": {"type": "regex", "regex": "w5+"}})
    assert servicer.scheduler.requests[-1].params.grammar.text == "w5+"
    _client(http).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w4"}],
                                          response_format={"type": "text"})
    assert servicer.scheduler.requests[-1].params.grammar is None


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("fields, kind, text", [
    ({"guided_json": SCHEMA}, "json_schema", json.dumps(SCHEMA)),
    ({"guided_json": json.dumps(SCHEMA)}, "json_schema", json.dumps(SCHEMA)),
    ({"guided_regex": "w5+"}, "regex", "w5+"),
    ({"guided_grammar": 'root ::= "w5"'}, "ebnf", 'root ::= "w5"'),
    ({"guided_choice": ["w5", 'say "w6"']}, "ebnf", 'root ::= "w5" | "say \\"w6\\""'),
    ({"structured_outputs": {"json": SCHEMA}}, "json_schema", json.dumps(SCHEMA)),
    ({"structured_outputs": {"choice": ["w5"]}}, "ebnf", 'root ::= "w5"'),
    ({"structured_outputs": {"regex": "w5+"}}, "regex", "w5+"),
    ({"structured_outputs": {"grammar": 'root ::= "w5"'}}, "ebnf", 'root ::= "w5"'),
    ({"structured_outputs": {"json_object": True}}, "json_object", ""),
    ({"guided_json": None, "response_format": {"type": "text"}}, None, None),
])
def test_vllm_s_guided_fields_and_structured_outputs_are_the_same_grammars(server, fields, kind, text):
    servicer, http = server
    for route in ("chat", "completions"):
        if route == "chat":
            _client(http).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w4"}],
                                                  max_tokens=2, extra_body=fields)
        else:
            _client(http).completions.create(model=MODEL, prompt="w4", max_tokens=2, extra_body=fields)
        g = servicer.scheduler.requests[-1].params.grammar
        assert (g.kind, g.text) == (kind, text) if kind else g is None


def test_a_forced_tool_call_takes_no_other_grammar(server):
    servicer, http = server
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    for extra in ({"guided_choice": ["w5"]}, {"response_format": {"type": "json_object"}}):
        with pytest.raises(openai.BadRequestError) as err:
            _client(http).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w4"}], tools=tools,
                                                  tool_choice="required", max_tokens=2, extra_body=extra)
        assert "cannot be combined with tool_choice 'required'" in err.value.body["message"], err.value.body


@pytest.mark.parametrize("fields, needle, param", [
    ({"guided_json": "{not json"}, "guided_json is not valid JSON", "guided_json"),
    ({"guided_json": [1]}, "guided_json must be a JSON schema object", "guided_json"),
    ({"guided_choice": []}, "guided_choice must be a list of 1 to 1024 non-empty strings", "guided_choice"),
    ({"guided_choice": ["w5", ""]}, "guided_choice must be a list of 1 to 1024 non-empty strings", "guided_choice"),
    ({"guided_regex": ""}, "guided_regex must be a non-empty string", "guided_regex"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs takes one of json, regex", "structured_outputs"),
    ({"guided_regex": "w5+", "response_format": {"type": "json_object"}},
     "response_format and guided_regex each ask for structured output: send one of them", "guided_regex"),
    ({"structured_outputs": {"regex": "w5+", "choice": ["w5"]}},
     "structured_outputs.regex and structured_outputs.choice each ask", "structured_outputs"),
])
def test_bad_or_doubled_structured_output_fields_are_400(server, fields, needle, param):
    servicer, http = server
    before = len(servicer.scheduler.requests)
    with pytest.raises(openai.BadRequestError) as err:
        _client(http).completions.create(model=MODEL, prompt="w4", max_tokens=2, extra_body=fields)
    assert needle in err.value.body["message"] and err.value.body["param"] == param, err.value.body
    assert len(servicer.scheduler.requests) == before


@pytest.mark.parametrize("fields, needle, param", [
    ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2]", "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty must be in [-2, 2]", "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty must be in [0.01, 10]", "repetition_penalty"),
    ({"logit_bias": {"5": 101}}, "logit_bias of token 5 must be in [-100, 100]", "logit_bias"),
    ({"logit_bias": {"999": 1}}, "outside the vocabulary", "logit_bias"),
    ({"logit_bias": {"w5": 1}}, "logit_bias keys must be token ids", "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "at most 300 token ids", "logit_bias"),
    ({"response_format": {"type": "xml"}}, "response_format.type must be one of", "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "the schema as a JSON object",
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"d": "x" * 70000}}}},
     "at most 65536 are allowed", "response_format"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos cannot be combined with a grammar",
     "ignore_eos"),
])
def test_bad_penalties_and_formats_are_400_with_the_rule(server, fields, needle, param):
    """Each refusal names its rule, and in `param` the field to fix (the openai client's
    BadRequestError.param; a range the engines check reached the client with param null)."""
    servicer, http = server
    before = len(servicer.scheduler.requests)
    with pytest.raises(openai.BadRequestError) as err:
        _client(http).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w4"}],
                                              extra_body=fields)
    body = err.value.body
    assert err.value.status_code == 400 and needle in body["message"] and body["param"] == param, body
    assert len(servicer.scheduler.requests) == before  # refused before the scheduler


@pytest.mark.parametrize("fields, needle", [
    ({"use_beam_search": True}, "use_beam_search is not supported by this server (or leave it out)"),
    ({"prompt_logprobs": 21}, "prompt_logprobs must be in [0, 20]"),
    ({"prompt_logprobs": -1}, "prompt_logprobs must be in [0, 20]"),
    ({"prompt_logprobs": 2, "stream": True}, "prompt_logprobs is not available with stream"),
    ({"prompt_logprobs": 2, "truncate_prompt_tokens": 1}, "prompt_logprobs cannot be combined with truncate_prompt_tokens"),
])
def test_vllm_extensions_that_would_change_the_answer_are_400_not_ignored(server, fields, needle):
    servicer, http = server
    before = len(servicer.scheduler.requests)
    for route in ("chat", "completions"):
        with pytest.raises(openai.BadRequestError) as err:
            if route == "chat":
                _client(http).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w4"}],
                                                      max_tokens=2, extra_body=fields)
            else:
                _client(http).completions.create(model=MODEL, prompt="w4", max_tokens=2, extra_body=fields)
        body = err.value.body
        assert err.value.status_code == 400 and needle in body["message"] and body["param"] == next(iter(fields)), body
    assert len(servicer.scheduler.requests) == before


def test_vllm_prompt_logprobs_in_vllm_s_shape(server):
    """completions: in the choice; chat: beside the choices. null for the first prompt token, then
    {id: {logprob, rank, decoded_token}}: the prompt's token with the verifier's rank, and the n
    most likely with ranks 1..n (the scripted scheduler: token t scores -t / 100 with rank t, its
    alternatives t, t+1, ...). With echo and logprobs too, each gets its own count."""
    servicer, http = server
    out = _post_json(http, "/v1/completions", {"model": MODEL, "prompt": "w4 w5 w7", "max_tokens": 2,
                                                         "prompt_logprobs": 2, "echo": True, "logprobs": 1})
    (c,) = out["choices"]
    assert servicer.scheduler.requests[-1].prompt_logprobs == 2  # the larger of the two counts
    assert c["prompt_logprobs"] == [None,
                                    {"5": {"logprob": -0.05, "rank": 5, "decoded_token": "w5"},
                                     "6": {"logprob": -0.06, "rank": 2, "decoded_token": "w6"}},
                                    {"7": {"logprob": -0.07, "rank": 7, "decoded_token": "w7"},
                                     "8": {"logprob": -0.08, "rank": 2, "decoded_token": "w8"}}]
    assert [len(t) for t in c["logprobs"]["top_logprobs"][1:3]] == [1, 1]  # echo's own logprobs: 1
    out = _post_json(http, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "w4"}],
                                                              "max_tokens": 2, "prompt_logprobs": 0})
    ids = servicer.scheduler.requests[-1].prompt_token_ids  # [2, 4, 3]: the scripted template
    assert out["prompt_logprobs"] == [None, *({str(t): {"logprob": -t / 100, "rank": t, "decoded_token": f"w{t}"}}
                                              for t in ids[1:])]
    assert "prompt_logprobs" not in out["choices"][0]
    plain = _post_json(http, "/v1/completions", {"model": MODEL, "prompt": "w4", "max_tokens": 2})
    assert "prompt_logprobs" not in plain["choices"][0] and servicer.scheduler.requests[-1].prompt_logprobs is None


def test_prompt_logprobs_from_a_verifier_without_ranks_are_refused(server):
    """A split gateway whose verifier does not list logprob_ranks (older than TokenLogprob.rank):
    400 naming the field, nothing submitted; echo with logprobs still scores the prompt."""
    servicer, http = server
    before, limits = len(servicer.scheduler.requests), servicer.limits
    servicer.limits = Limits(limits.vocab_size, limits.max_model_len, frozenset({"min_tokens", "min_p"}))
    try:
        with pytest.raises(openai.BadRequestError) as err:
            _client(http).completions.create(model=MODEL, prompt="w4 w5", max_tokens=2, extra_body={"prompt_logprobs": 1})
        assert err.value.body["param"] == "prompt_logprobs" and "upgrade the verifier" in err.value.body["message"]
        assert len(servicer.scheduler.requests) == before
        out = _client(http).completions.create(model=MODEL, prompt="w4 w5", max_tokens=2, echo=True, logprobs=1)
        assert out.choices[0].logprobs.token_logprobs[1] == -0.05
    finally:
        servicer.limits = limits


def test_tokenize_and_detokenize(server):
    """vLLM's /tokenize: the ids the servicer's tokenization gives a generation request (a text,
    or chat messages with their template options), their count and max_model_len; /detokenize
    back; /version. Nothing reaches the scheduler."""
    servicer, http = server
    before = len(servicer.scheduler.requests)
    out = _post_json(http, "/tokenize", {"model": MODEL, "prompt": "w4 w5 w6", "return_token_strs": True})
    assert out == {"count": 3, "max_model_len": 64, "tokens": [4, 5, 6], "token_strs": ["w4", "w5", "w6"]}
    out = _post_json(http, "/tokenize", {"messages": [{"role": "user", "content": "w4"}, {"role": "assistant", "content": "w5"}],
                                         "continue_final_message": True, "add_generation_prompt": False})
    assert out["tokens"] == [2, 4, 2, 5, 3] and out["token_strs"] is None
    msg = servicer.tokenized  # what the servicer's Tokenizer was asked to render
    assert msg.continue_final_message and not msg.add_generation_prompt and [m.role for m in msg.messages] == ["user", "assistant"]
    assert _post_json(http, "/detokenize", {"model": MODEL, "tokens": [4, 5, 6]}) == {"prompt": "w4 w5 w6"}
    assert _post_json(http, "/detokenize", {"tokens": []}) == {"prompt": ""}
    from specsplit import __version__
    with urllib.request.urlopen(f"http://127.0.0.1:{http.port}/version", timeout=10) as r:
        assert json.loads(r.read()) == {"version": __version__}
    assert len(servicer.scheduler.requests) == before


@pytest.mark.parametrize("path, body, param, needle", [
    ("/tokenize", {"prompt": "w4", "messages": [{"role": "user", "content": "w4"}]}, "prompt", "one of the two"),
    ("/tokenize", {}, "prompt", "one of the two"),
    ("/tokenize", {"prompt": ""}, "prompt", "the prompt is empty"),
    ("/tokenize", {"messages": []}, "messages", "at least one message"),
    ("/tokenize", {"prompt": "w4", "add_special_tokens": False}, "add_special_tokens", "add_special_tokens false is not supported"),
    ("/tokenize", {"prompt": "w4", "model": "other"}, "model", "does not exist"),
    ("/tokenize", {"messages": [{"role": "user", "content": "w4"}], "continue_final_message": True}, "continue_final_message",
     "continue_final_message needs the last message to be the assistant's"),
    ("/detokenize", {"tokens": [4, 256]}, "tokens", "outside the vocabulary [0, 256)"),
    ("/detokenize", {"tokens": [1] * 257}, "tokens", "at most 256 (4 x max_model_len)"),
    ("/detokenize", {"tokens": "w4"}, "tokens", "tokens"),
])
def test_tokenize_and_detokenize_refusals_are_400_naming_the_field(server, path, body, param, needle):
    _, http = server
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(_post(http, path, body), timeout=10)
    out = json.loads(err.value.read())["error"]
    assert err.value.code == (404 if param == "model" else 400) and needle in out["message"] and out["param"] == param, out


def test_min_tokens_min_p_and_include_stop_reach_the_request_and_bad_values_are_refused(server):
    servicer, http = server
    _client(http).completions.create(model=MODEL, prompt="w4", max_tokens=4, stop=["w9"],
                                     extra_body={"min_tokens": 3, "min_p": 0.05, "include_stop_str_in_output": True})
    req = servicer.scheduler.requests[-1]
    assert (req.params.min_tokens, req.params.min_p, req.stop, req.include_stop_str_in_output) == (3, 0.05, ("w9",), True)
    with pytest.raises(openai.BadRequestError) as err:
        _client(http).completions.create(model=MODEL, prompt="w4", max_tokens=4, extra_body={"min_p": 1.5})
    assert err.value.body["param"] == "min_p" and "min_p must be in [0, 1]" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        _client(http).completions.create(model=MODEL, prompt="w4", max_tokens=4, extra_body={"min_tokens": -1})
    assert err.value.body["param"] == "min_tokens" and "min_tokens must be >= 0" in err.value.body["message"]


def test_truncate_prompt_tokens_reaches_the_request_but_not_with_echo(server):
    servicer, http = server
    _client(http).completions.create(model=MODEL, prompt="w4 w5 w6", max_tokens=2, extra_body={"truncate_prompt_tokens": 2})
    assert servicer.tokenized.truncate_prompt_tokens == 2
    assert servicer.scheduler.requests[-1].prompt_token_ids == (5, 6)
    with pytest.raises(openai.BadRequestError) as err:
        _client(http).completions.create(model=MODEL, prompt="w4 w5 w6", max_tokens=2, echo=True,
                                         extra_body={"truncate_prompt_tokens": 2})
    assert err.value.body["param"] == "truncate_prompt_tokens" and "cannot be combined with echo" in err.value.body["message"]


def test_chat_template_options_reach_the_request(server):
    servicer, http = server
    messages = [{"role": "user", "content": "w4"}, {"role": "assistant", "content": "w5"}]
    _client(http).chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                          extra_body={"continue_final_message": True, "add_generation_prompt": False})
    msg = servicer.tokenized
    assert msg.continue_final_message and msg.HasField("add_generation_prompt") and not msg.add_generation_prompt
    _client(http).chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert not servicer.tokenized.continue_final_message and not servicer.tokenized.HasField("add_generation_prompt")


def test_vllm_extensions_at_their_neutral_values_and_unknown_fields_are_accepted(server):
    servicer, http = server
    neutral = {"min_p": 0.0, "min_tokens": 0, "use_beam_search": False,
               "add_generation_prompt": True, "some_future_field": {"x": 1}}
    out = _client(http).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w4"}],
                                                max_tokens=2, temperature=0, extra_body=neutral)
    assert out.choices[0].finish_reason in ("length", "stop")


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_tools_and_calls_reach_the_servicer_s_tokenizer(server):
    """Chat tools go to the servicer as GenerateRequest.tools_json and each message's calls as
    tool_calls_json (arguments as an object) and tool_call_id: its Tokenizer renders them, with the
    model's chat template or the Hermes block (gateway/chat_prompt.py, tests/unit/gateway/test_chat_prompt.py)."""
    servicer, http = server
    messages = [{"role": "user", "content": "w4"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "content": "w5", "tool_call_id": "call_1"}]
    _client(http).chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=2)
    msg = servicer.tokenized
    assert json.loads(msg.tools_json) == [WEATHER]
    assert [m.role for m in msg.messages] == ["user", "assistant", "tool"]  # not rendered here
    assert json.loads(msg.messages[1].tool_calls_json) == [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris"}}}]
    assert msg.messages[2].tool_call_id == "call_1" and msg.messages[0].tool_calls_json == ""
    _client(http).chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none",
                                          max_tokens=2)
    assert servicer.tokenized.tools_json == ""  # none: no functions rendered
    with pytest.raises(openai.BadRequestError) as err:
        _client(http).chat.completions.create(model=MODEL, tools=[WEATHER], messages=[
            {"role": "user", "content": "w4", "tool_calls": messages[1]["tool_calls"]}])
    assert err.value.body["param"] == "messages" and "only allowed on assistant messages" in err.value.body["message"]


def test_a_tool_answer_streams_as_it_comes_with_its_logprobs(server):
    """With tools the answer is parsed as it comes (gateway/tool_stream.py ToolCallStream): a plain one
    arrives in a content delta per event (the whitespace at each end held until more content
    comes, or the answer ends without a call), every token's logprobs with it, and joins to the
    non-streamed answer."""
    servicer, http = server
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "w4"}], tools=[WEATHER], max_tokens=5, logprobs=True)
    try:
        for finish, content in (("length", "w5 w6 w7 w8 w9"), ("stop", "w5 w6 w7 w8 ")):
            servicer.scheduler.finish = finish
            whole = _client(http).chat.completions.create(**kw).choices[0]
            chunks = [c.choices[0] for c in _client(http).chat.completions.create(**kw, stream=True)]
            deltas = [c.delta.content for c in chunks if c.delta.content]
            assert "".join(deltas) == whole.message.content == content and len(deltas) >= 2, deltas
            assert [t.token for c in chunks if c.logprobs for t in c.logprobs.content] == \
                [t.token for t in whole.logprobs.content] == [f"w{t}" for t in range(5, 10)]
            assert chunks[-1].finish_reason == whole.finish_reason == finish
            assert not any(c.delta.tool_calls for c in chunks) and whole.message.tool_calls is None
    finally:
        servicer.scheduler.finish = "length"
