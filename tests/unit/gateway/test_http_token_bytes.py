"""The HTTP API's logprobs where characters are split over tokens: SmolLM2's real tokenizer (through
the servicer's Tokenizer) and a scripted scheduler that streams real token ids two at a time, its
text from the server's own TextStream (so events end inside a character). The chat logprobs'
bytes join to the answer's bytes, pieces of characters are named `bytes:\\xNN..`, and the
completions' text_offset points at the character each token starts (or continues), streamed or
not. The emoji answer of issue-style reports (ollama #13497): every piece read [239, 191, 189]."""
from __future__ import annotations

import threading
import time

import pytest

from specsplit.detokenizer import TextStream
from tests.helpers.http_app import serving
from specsplit.gateway.service import GatewayServicer, Tokenizer
from specsplit.request import Event, Limits, TokenLogprob

openai = pytest.importorskip("openai")

MODEL = "smollm2"
ANSWER = "Party 🎉 time, 你好! café 😀"
PROMPT = "Say 🎉 twice"


class _Scheduler:
    """Streams ANSWER's ids, two per event; logprobs: each token at -0.1, its alternatives the next
    ids of the answer (pieces of characters among them)."""

    inflight = 0

    def __init__(self, tokenizer: Tokenizer):
        self.tok = tokenizer
        self.ids = tokenizer.encode(ANSWER)
        self.scheduler = type("Core", (), {"eos_token_ids": (2,)})()

    def submit(self, req, sink):
        threading.Thread(target=self._run, args=(req, sink), daemon=True).start()
        return req

    def _run(self, req, sink):
        ids = self.ids[: req.max_tokens]
        text = TextStream(self.tok.decode)
        prompt = None
        if req.prompt_logprobs is not None:
            prompt = tuple(TokenLogprob(t, -0.2, ()) for t in req.prompt_token_ids[1:])
        for i in range(0, len(ids), 2):
            time.sleep(0.005)
            chunk = ids[i:i + 2]
            for t in chunk:
                text.add(t)
            last = i + 2 >= len(ids)
            lps = None
            if req.logprobs is not None:
                lps = [TokenLogprob(t, -0.1, tuple((a, -1.0 - j) for j, a in enumerate(self.ids[i + k:i + k + req.logprobs])))
                       for k, t in enumerate(chunk)]
            usage = {"prompt_tokens": len(req.prompt_token_ids), "completion_tokens": len(ids)} if last else None
            sink(Event(chunk, text.take(final=last), "length" if last else None, usage, logprobs=lps,
                       prompt_logprobs=prompt if i == 0 else None))

    def abort(self, request, reason="cancelled"):
        pass


class _Servicer(GatewayServicer):
    def __init__(self, tokenizer):
        super().__init__(_Scheduler(tokenizer), tokenizer, Limits(vocab_size=len(tokenizer.tokenizer), max_model_len=256),
                         None)

    async def admit(self, req):
        pass


@pytest.fixture(scope="module")
def http():
    from specsplit.models.loader import hf_dir_for, load_tokenizer

    servicer = _Servicer(Tokenizer(load_tokenizer(hf_dir_for("smollm2-135m", show_progress=False))))
    with serving(servicer, MODEL) as server:
        yield servicer, server


def _client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0, timeout=10)


def _char_starts(tok: Tokenizer, ids) -> list[int]:
    """Per token, the character of the ids' text that holds its first byte (from the tokens' bytes:
    a byte-level tokenizer's text is their concatenation)."""
    out, raw = [], b""
    for t in ids:
        out.append(len(raw.decode("utf-8", "ignore")))
        raw += tok.token_bytes(t)
    return out


def test_chat_logprobs_bytes_join_to_the_answer(http):
    servicer, server = http
    n = len(servicer.scheduler.ids)
    res = _client(server).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                                                   max_tokens=n, logprobs=True, top_logprobs=2)
    content = res.choices[0].logprobs.content
    assert res.choices[0].message.content == ANSWER
    assert b"".join(bytes(c.bytes) for c in content) == ANSWER.encode()
    pieces = [c for c in content if c.token.startswith("bytes:")]
    assert len(pieces) >= 6 and all(bytes(c.bytes) != "\ufffd".encode() for c in pieces)
    for c in pieces:  # the name spells the bytes
        assert c.token == "bytes:" + "".join(f"\\x{b:02x}" for b in c.bytes)
    assert "\ufffd" not in "".join(c.token for c in content)
    for c in content:  # the alternatives are named and carry bytes the same way (the first is the token)
        assert (c.top_logprobs[0].token, c.top_logprobs[0].bytes) == (c.token, c.bytes)
    streamed = [lp for ch in _client(server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=n, logprobs=True, top_logprobs=2,
        stream=True) if ch.choices and ch.choices[0].logprobs for lp in ch.choices[0].logprobs.content]
    assert [(c.token, c.bytes) for c in streamed] == [(c.token, c.bytes) for c in content]


def test_completion_text_offset_points_at_each_tokens_character(http):
    servicer, server = http
    tok, ids = servicer.tokenizer, servicer.scheduler.ids
    res = _client(server).completions.create(model=MODEL, prompt=PROMPT, max_tokens=len(ids), logprobs=1)
    c = res.choices[0]
    assert c.text == ANSWER
    assert c.logprobs.text_offset == _char_starts(tok, ids)
    assert len(set(c.logprobs.tokens)) == len(set(ids))  # distinct pieces are distinct names (no '�' for all)
    streamed = list(_client(server).completions.create(model=MODEL, prompt=PROMPT, max_tokens=len(ids), logprobs=1,
                                                        stream=True))
    assert "".join(ch.choices[0].text for ch in streamed) == ANSWER
    assert [o for ch in streamed for o in ch.choices[0].logprobs.text_offset] == c.logprobs.text_offset
    # events that end inside a character (its bytes in two events) are among them
    assert any(ch.choices[0].logprobs.tokens[-1].startswith("bytes:") for ch in streamed[:-1])


def test_echo_offsets_count_the_prompts_characters(http):
    servicer, server = http
    tok, ids = servicer.tokenizer, servicer.scheduler.ids
    prompt_ids = tok.encode(PROMPT)
    res = _client(server).completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, logprobs=0, echo=True)
    c = res.choices[0]
    assert c.text == PROMPT + tok.decode(ids[:2])
    assert c.logprobs.text_offset == _char_starts(tok, prompt_ids) + [len(PROMPT) + o for o in _char_starts(tok, ids[:2])]
    assert [t for t in c.logprobs.tokens[:len(prompt_ids)] if t.startswith("bytes:")]
