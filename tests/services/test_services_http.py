"""The OpenAI-compatible HTTP API (gateway/http_api.py) through a real `specsplit serve --http-port`
with a bearer token, driven by the official `openai` client: chat streamed == not streamed, stop
strings, seeds, logprobs, OpenAI error bodies and status codes, /health, /metrics, and a client
that disconnects mid-stream leaving nothing allocated.

The server runs the tiny target (plus its close draft) with a chat template added: a turn is its
role's word (w1 system, w2 user, w3 assistant) then its words; the generation prompt is w3.
"""
from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request

import pytest

from tests.services.procs import HOST, ServiceProcess, TINY_ENGINE, SPECULATE_ALWAYS, free_port, http_call, wait_for

openai = pytest.importorskip("openai")

TOKEN = "http-test-token"
CHAT_TEMPLATE = ("{% for m in messages %}{{ {'system': 'w1', 'user': 'w2', 'assistant': 'w3'}.get(m['role'], 'w4') }} "
                 "{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w3{% endif %}")
MESSAGES = [{"role": "system", "content": "w9 w10"}, {"role": "user", "content": "w5 w6 w7 w8"}]


@pytest.fixture(scope="module")
def http_server(tmp_path_factory, tiny_llama, tiny_draft_close):
    root = tmp_path_factory.mktemp("http")
    target = root / "tiny-chat"
    shutil.copytree(tiny_llama, target)
    cfg_path = target / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(cfg, indent=2))
    token_file = root / "token"
    token_file.write_text(TOKEN + "\n")
    port, http_port = free_port(), free_port()
    argv = ["serve", "--target", str(target), "--draft", str(tiny_draft_close), "--port", str(port),
            "--http-port", str(http_port), "--auth-token-file", str(token_file), "--max-num-seqs", "4",
            *TINY_ENGINE, *SPECULATE_ALWAYS]
    proc = ServiceProcess("http-serve", argv, root, port)
    proc.serving(240)
    proc.http_port = http_port
    proc.model = str(target)
    proc.token_file = token_file
    try:
        yield proc
    finally:
        assert proc.stop() == 0, proc.log_tail()


def _client(srv, api_key: str = TOKEN):
    return openai.OpenAI(base_url=f"http://{HOST}:{srv.http_port}/v1", api_key=api_key, max_retries=0, timeout=60)


def _info(srv):
    """GetServerInfo over gRPC, with the token."""
    from specsplit.v1 import gateway_pb2, gateway_pb2_grpc
    from specsplit.rpc.security import ClientSecurity, channel

    with channel(srv.address, ClientSecurity(auth_token_file=str(srv.token_file))) as ch:
        return gateway_pb2_grpc.GatewayStub(ch).GetServerInfo(gateway_pb2.GetServerInfoRequest(), timeout=5)


def _get(srv, path: str, token: str | None = None) -> tuple[int, str]:
    req = urllib.request.Request(f"http://{HOST}:{srv.http_port}{path}")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_the_http_address_is_logged(http_server):
    assert f"OpenAI-compatible HTTP API on http://{HOST}:{http_server.http_port}/v1" in http_server.log_tail(200)


def test_models_lists_the_target(http_server):
    models = _client(http_server).models.list()
    assert [m.id for m in models.data] == [http_server.model]


def test_chat_streamed_equals_not_streamed(http_server):
    client = _client(http_server)
    kw = dict(model=http_server.model, messages=MESSAGES, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw)
    choice = full.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert full.usage.completion_tokens == 12 and full.usage.total_tokens == full.usage.prompt_tokens + 12
    # the template: w1 w9 w10 w2 w5 w6 w7 w8 w3
    assert full.usage.prompt_tokens == 9

    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content and len(text.split()) == 12


def test_completions_text_ids_and_stop(http_server):
    client = _client(http_server)
    base = client.completions.create(model=http_server.model, prompt="w5 w6 w7", max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert base.object == "text_completion" and base.choices[0].finish_reason == "length"
    words = base.choices[0].text.split()
    assert len(words) == 8
    # the same prompt as token ids, and as a list of one string
    ids = client.completions.create(model=http_server.model, prompt=[5 + 3, 6 + 3, 7 + 3], max_tokens=8,
                                    temperature=0, extra_body={"ignore_eos": True})
    one = client.completions.create(model=http_server.model, prompt=["w5 w6 w7"], max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert ids.choices[0].text == base.choices[0].text == one.choices[0].text
    # a stop string: the text ends before it, finish_reason "stop"
    stop = words[3]
    cut = client.completions.create(model=http_server.model, prompt="w5 w6 w7", max_tokens=8, temperature=0,
                                    stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].finish_reason == "stop"
    assert stop not in cut.choices[0].text and base.choices[0].text.startswith(cut.choices[0].text)


def test_completions_stream_matches(http_server):
    client = _client(http_server)
    kw = dict(model=http_server.model, prompt="w11 w12", max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_seed_reproduces_a_sample(http_server):
    client = _client(http_server)
    kw = dict(model=http_server.model, prompt="w5 w6", max_tokens=12, temperature=1.0,
              extra_body={"ignore_eos": True})
    a = client.completions.create(**kw, seed=7).choices[0].text
    b = client.completions.create(**kw, seed=7).choices[0].text
    c = client.completions.create(**kw, seed=8).choices[0].text
    assert a == b
    assert a != c  # 12 tokens at temperature 1 over 256 words: another seed, another sample


def test_completions_with_logprobs(http_server):
    res = _client(http_server).completions.create(model=http_server.model, prompt="w5 w6 w7", max_tokens=6,
                                                  temperature=0, logprobs=3, extra_body={"ignore_eos": True})
    lp = res.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert " ".join(lp.tokens) == res.choices[0].text.strip()
    for tok, p, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert p <= 0.0 and len(top) == 3
        # greedy: the chosen token is the most likely one
        assert max(top.values()) == pytest.approx(p, abs=1e-4) and top.get(tok) == pytest.approx(p, abs=1e-4)
    assert lp.text_offset == sorted(lp.text_offset)


def test_chat_logprobs(http_server):
    res = _client(http_server).chat.completions.create(model=http_server.model, messages=MESSAGES, max_tokens=4,
                                                       temperature=0, logprobs=True, top_logprobs=2,
                                                       extra_body={"ignore_eos": True})
    lp = res.choices[0].logprobs
    assert len(lp.content) == 4
    for c in lp.content:
        assert c.logprob <= 0.0 and len(c.top_logprobs) == 2 and c.bytes == list(c.token.encode())


def _post(srv, path: str, body: dict, token: str | None = TOKEN) -> tuple[int, dict]:
    status, raw = http_call(srv.http_port, path, body, timeout=60, host=HOST, token=token)
    return status, json.loads(raw)


def test_tokenize_counts_what_generation_reads(http_server):
    """vLLM's /tokenize on the real tokenizer and chat template: a text's ids and a chat's are the
    prompts that completions and chat count in usage (and echo back); /detokenize inverts; the
    bearer token is needed as on every route but /health."""
    client = _client(http_server)
    status, text = _post(http_server, "/tokenize", {"model": http_server.model, "prompt": "w5 w6 w7",
                                                     "return_token_strs": True})
    assert status == 200 and text["max_model_len"] == 256 and text["count"] == len(text["tokens"]), text
    done = client.completions.create(model=http_server.model, prompt="w5 w6 w7", max_tokens=1, echo=True, logprobs=0)
    assert done.usage.prompt_tokens == text["count"] and done.choices[0].logprobs.tokens[:text["count"]] == text["token_strs"]
    status, chat = _post(http_server, "/tokenize", {"messages": MESSAGES})
    assert status == 200 and chat["token_strs"] is None
    answer = client.chat.completions.create(model=http_server.model, messages=MESSAGES, max_tokens=1)
    assert answer.usage.prompt_tokens == chat["count"]
    status, back = _post(http_server, "/detokenize", {"tokens": chat["tokens"]})
    assert status == 200 and back["prompt"].split() == "w1 w9 w10 w2 w5 w6 w7 w8 w3".split(), back  # the template's words
    assert _post(http_server, "/tokenize", {"prompt": "w5"}, token=None)[0] == 401
    status, err = _post(http_server, "/detokenize", {"tokens": [10**6]})
    assert status == 400 and err["error"]["param"] == "tokens"


def test_grpc_tokenize_equals_the_http_route(http_server):
    """Gateway.Tokenize: the same ids as /tokenize for a text and a chat (the HTTP route calls it);
    both or neither of prompt and messages is INVALID_ARGUMENT; the token is needed."""
    import grpc

    from specsplit.rpc.security import ClientSecurity, channel
    from specsplit.v1 import gateway_pb2, gateway_pb2_grpc

    turns = [gateway_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in MESSAGES]
    with channel(http_server.address, ClientSecurity(auth_token_file=str(http_server.token_file))) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        text = stub.Tokenize(gateway_pb2.TokenizeRequest(prompt="w5 w6 w7"), timeout=30)
        chat = stub.Tokenize(gateway_pb2.TokenizeRequest(messages=turns), timeout=30)
        bare = stub.Tokenize(gateway_pb2.TokenizeRequest(messages=turns, add_generation_prompt=False), timeout=30)
        for bad in (gateway_pb2.TokenizeRequest(), gateway_pb2.TokenizeRequest(prompt="w5", messages=turns)):
            with pytest.raises(grpc.RpcError) as err:
                stub.Tokenize(bad, timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "one of the two" in err.value.details()
    assert list(text.token_ids) == _post(http_server, "/tokenize", {"prompt": "w5 w6 w7"})[1]["tokens"]
    assert list(chat.token_ids) == _post(http_server, "/tokenize", {"messages": MESSAGES})[1]["tokens"]
    assert len(bare.token_ids) < len(chat.token_ids) and chat.max_model_len == 256  # no generation prompt (w3)
    with channel(http_server.address) as ch, pytest.raises(grpc.RpcError) as err:
        gateway_pb2_grpc.GatewayStub(ch).Tokenize(gateway_pb2.TokenizeRequest(prompt="w5"), timeout=30)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_chat_prompt_logprobs_are_the_rendered_prompt_s(http_server):
    """vLLM's prompt_logprobs on chat: beside the choices, the scores of the template's tokens,
    equal to those /v1/completions gives for the rendered text (w1 w9 w10 w2 w5 w6 w7 w8 w3)."""
    def post(path: str, body: dict) -> dict:
        status, out = _post(http_server, path, {"model": http_server.model, **body})
        assert status == 200, out
        return out

    chat = post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, "temperature": 0, "n": 2,
                                         "prompt_logprobs": 1})
    text = post("/v1/completions", {"prompt": "w1 w9 w10 w2 w5 w6 w7 w8 w3", "max_tokens": 2, "temperature": 0,
                                    "prompt_logprobs": 1})
    scored = chat["prompt_logprobs"]
    assert len(scored) == chat["usage"]["prompt_tokens"] == text["usage"]["prompt_tokens"] and scored[0] is None
    assert all("prompt_logprobs" not in c for c in chat["choices"]) and len(chat["choices"]) == 2
    want = text["choices"][0]["prompt_logprobs"]
    assert [list(d) for d in scored[1:]] == [list(d) for d in want[1:]]  # the same tokens, the same alternatives
    for mine, theirs in zip(scored[1:], want[1:]):
        for k, v in mine.items():
            assert v["rank"] == theirs[k]["rank"] and v["logprob"] == pytest.approx(theirs[k]["logprob"], abs=1e-5)
    with pytest.raises(openai.BadRequestError) as err:
        _client(http_server).chat.completions.create(model=http_server.model, messages=MESSAGES, max_tokens=2,
                                                     stream=True, extra_body={"prompt_logprobs": 1})
    assert err.value.body["param"] == "prompt_logprobs" and "not available with stream" in err.value.body["message"]


@pytest.mark.parametrize("kw, param, message", [
    (dict(temperature=-1), "temperature", "temperature"),
    (dict(max_tokens=0), "max_tokens", "max_tokens"),
    (dict(max_tokens=-3), "max_tokens", "max_tokens must be >= 1"),
    (dict(n=17), "n", "n must be in [1, 16]"),
    (dict(max_tokens=10_000), "max_tokens", "leaves no room for the prompt in max_model_len"),
    (dict(max_tokens=255), None, "tokens) + max_tokens (255) = "),
    (dict(logprobs=50), "logprobs", "logprobs"),
    (dict(top_p=1.5), "top_p", "top_p"),
    (dict(prompt=["w5", ""]), "prompt", "prompt 1 of the batch is empty"),
    (dict(prompt=[1, 100_000]), "prompt", "outside the vocabulary"),
    (dict(stop=[""]), "stop", "stop"),
    (dict(extra_body={"temperature": "warm"}), "temperature", "temperature"),
])
def test_invalid_request_is_400_with_an_openai_error(http_server, kw, param, message):
    args = dict(model=http_server.model, prompt="w5 w6", max_tokens=4)
    args.update(kw)
    with pytest.raises(openai.BadRequestError) as err:
        _client(http_server).completions.create(**args)
    assert err.value.status_code == 400
    body = err.value.body
    assert body["type"] == "invalid_request_error" and message in body["message"] and body["param"] == param


def test_invalid_chat_and_json(http_server):
    client = _client(http_server)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=http_server.model, messages=[{"role": "user"}], max_tokens=2,
                                       top_logprobs=2)
    assert "logprobs" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:  # a required field missing: FastAPI's 422 becomes 400
        client.chat.completions.create(model=http_server.model, messages=None, max_tokens=2)
    assert err.value.body["param"] == "messages"
    req = urllib.request.Request(f"http://{HOST}:{http_server.http_port}/v1/completions", data=b"{not json",
                                 headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 400 and json.loads(e.value.read())["error"]["type"] == "invalid_request_error"


def test_unknown_model_and_route_are_404(http_server):
    client = _client(http_server)
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4o", prompt="w5", max_tokens=2)
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"
    status, body = _get(http_server, "/v1/nothing-here", TOKEN)
    assert status == 404 and json.loads(body)["error"]["message"] == "Invalid URL (GET /v1/nothing-here)"


def test_bearer_token_is_required(http_server):
    with pytest.raises(openai.AuthenticationError) as err:
        _client(http_server, api_key="wrong-token").completions.create(model=http_server.model, prompt="w5", max_tokens=2)
    assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
    status, body = _get(http_server, "/v1/models")
    assert status == 401 and "missing bearer token" in json.loads(body)["error"]["message"]


def test_health_is_open_and_metrics_need_the_token(http_server):
    assert _get(http_server, "/health") == (200, '{"status":"ok"}')
    status, body = _get(http_server, "/metrics")
    assert status == 401 and "missing bearer token" in json.loads(body)["error"]["message"]
    status, text = _get(http_server, "/metrics", TOKEN)
    assert status == 200 and "specsplit_generation_tokens_total" in text and "specsplit_requests_total" in text


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def _post_chunked(port: int, total: int, token: str | None) -> tuple[bytes, int, float]:
    """POST /v1/completions with a chunked body of `total` bytes (no Content-Length), sent 64 KiB at
    a time until the server answers. Returns (the response's first bytes, bytes sent, seconds)."""
    import select
    import socket
    import time

    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n")
    if token:
        head += f"Authorization: Bearer {token}\r\n".encode()
    chunk = b"a" * 65536
    frame = b"%x\r\n" % len(chunk) + chunk + b"\r\n"
    sent, t0 = 0, time.monotonic()
    with socket.create_connection((HOST, port), timeout=30) as s:
        s.sendall(head + b"\r\n")
        try:
            while sent < total and not select.select([s], [], [], 0)[0]:
                s.sendall(frame)
                sent += len(chunk)
            if sent >= total:
                s.sendall(b"0\r\n\r\n")
        except OSError:  # the server answered and closed while we were still sending
            pass
        response = s.recv(4096)
    return response, sent, time.monotonic() - t0


@pytest.mark.parametrize("token", [None, TOKEN], ids=["no-token", "token"])
def test_a_chunked_body_is_refused_before_it_is_buffered(http_server, token):
    """A 64 MB chunked POST (no Content-Length): without the token it is 401 before its body is
    read; with it, 413 as soon as it passes --max-request-bytes (4 MiB). Either way the answer
    comes before the client has sent it all, and the server's memory does not grow with it."""
    import threading

    pid, total = http_server.proc.pid, 64 * 1024 * 1024
    before, peak, done = _rss_kib(pid), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss_kib(pid))
            done.wait(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        response, sent, seconds = _post_chunked(http_server.http_port, total, token)
    finally:
        done.set()
        sampler.join(5)
    status = int(response.split(b" ", 2)[1]) if response.startswith(b"HTTP/1.1 ") else None
    print(f"chunked 64 MB, token={token is not None}: HTTP {status} after {sent} bytes in {seconds:.3f}s; "
          f"RSS {before} KiB -> peak {peak[0]} KiB")
    assert status == (413 if token else 401), response[:300]
    assert sent < total
    assert seconds < 10.0  # generous: the goal is well under 2 s
    assert peak[0] - before < 20 * 1024
    assert _get(http_server, "/health")[0] == 200


CANCELLED = 'specsplit_requests_total{outcome="cancelled"}'


def _metric(srv, name: str) -> float:
    text = _get(srv, "/metrics", TOKEN)[1]
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines() if line.startswith(name))


def test_a_client_that_disconnects_mid_stream_frees_its_request(http_server):
    """Read two chunks of a long stream, close the connection: the server aborts the request
    (running count back to 0, the abort counted) before max_tokens would have ended it."""
    import http.client

    cancelled_before = _metric(http_server, CANCELLED)
    conn = http.client.HTTPConnection(HOST, http_server.http_port, timeout=30)
    body = json.dumps({"model": http_server.model, "prompt": "w5 w6", "max_tokens": 200, "temperature": 0,
                       "ignore_eos": True, "stream": True})
    conn.request("POST", "/v1/completions", body, {"Authorization": f"Bearer {TOKEN}",
                                                   "Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("content-type").startswith("text/event-stream")
    seen = b""
    while seen.count(b"\n\n") < 2:
        seen += resp.read1(4096)
    assert seen.startswith(b"data: {")
    assert _info(http_server).num_running == 1
    conn.sock.shutdown(2)
    conn.close()
    assert wait_for(lambda: _info(http_server).num_running == 0, 10.0) is not None
    assert _info(http_server).num_waiting == 0
    assert wait_for(lambda: _metric(http_server, CANCELLED) > cancelled_before, 5.0) is not None


def test_a_non_streamed_client_that_disconnects_frees_its_request(http_server):
    import socket

    cancelled_before = _metric(http_server, CANCELLED)
    body = json.dumps({"model": http_server.model, "prompt": "w5 w6", "max_tokens": 250, "temperature": 0,
                       "ignore_eos": True}).encode()
    s = socket.create_connection((HOST, http_server.http_port), timeout=10)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Authorization: Bearer {TOKEN}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    assert wait_for(lambda: _info(http_server).num_running == 1, 10.0) is not None
    s.close()
    assert wait_for(lambda: _info(http_server).num_running == 0, 10.0) is not None
    assert wait_for(lambda: _metric(http_server, CANCELLED) > cancelled_before, 5.0) is not None



def test_split_gateway_serves_http_like_grpc(split_stack, prompts):
    """`specsplit gateway --http-port`: the same scheduler behind both APIs, the same greedy text
    and log-probabilities."""
    from tests.services.procs import generate, request

    ids = prompts[0]
    grpc_out = generate(split_stack.gateway, request(ids, max_tokens=10, ignore_eos=True, logprobs=2))
    client = openai.OpenAI(base_url=f"http://{HOST}:{split_stack.http_port}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    res = client.completions.create(model=model, prompt=ids, max_tokens=10, temperature=0, logprobs=2,
                                    extra_body={"ignore_eos": True})
    assert res.choices[0].text == grpc_out["text"] and res.usage.completion_tokens == 10
    want = [lp["logprob"] for lp in grpc_out["logprobs"]]
    assert res.choices[0].logprobs.token_logprobs == pytest.approx(want, abs=1e-5)
