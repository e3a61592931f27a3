"""A gateway in front of a verifier alone, with tiny limits (the `small_stack` fixture): a full
server refuses with RESOURCE_EXHAUSTED; a verifier killed mid-stream ends every stream with
UNAVAILABLE promptly and the gateway recovers when it is back; SIGTERM drains (NOT_SERVING, new
streams refused, live ones finish, exit 0). Its OpenAI-compatible HTTP API follows: 429 when
full, /health 503 and requests 503 while the verifier is down or the gateway drains."""
from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest

from specsplit.v1 import gateway_pb2_grpc
from tests.services.procs import generate, health, http_call, request, wait_for


def _http(stack, path: str, body: dict | None = None) -> tuple[int, dict]:
    """(status, JSON body) of a GET, or a POST of `body`, to the gateway's HTTP API."""
    status, raw = http_call(stack.http_port, path, body, timeout=10)
    return status, json.loads(raw)


def _completion(stack, ids, max_tokens: int = 4) -> tuple[int, dict]:
    model = _http(stack, "/v1/models")[1]["data"][0]["id"]
    return _http(stack, "/v1/completions", {"model": model, "prompt": list(ids), "max_tokens": max_tokens,
                                            "temperature": 0})


def _stream(address, req, timeout=60):
    ch = grpc.insecure_channel(address)
    return ch, gateway_pb2_grpc.GatewayStub(ch).Generate(req, timeout=timeout)


def test_full_server_is_resource_exhausted(small_stack, prompts):
    opened = []
    try:
        for i in range(2):  # running
            ch, call = _stream(small_stack.gateway, request(prompts[i], max_tokens=220, ignore_eos=True))
            next(call)
            opened.append((ch, call))
        ch, call = _stream(small_stack.gateway, request(prompts[2], max_tokens=8))  # queued
        opened.append((ch, call))
        time.sleep(0.3)
        with pytest.raises(grpc.RpcError) as err:
            generate(small_stack.gateway, request(prompts[3], max_tokens=8), timeout=10)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_queue" in err.value.details()
        status, body = _completion(small_stack, prompts[3])
        assert status == 429 and body["error"]["code"] == "rate_limit_exceeded", body
    finally:
        for ch, call in opened:
            call.cancel()
            ch.close()
    # Room again once the cancels are through.
    assert wait_for(lambda: _ok(small_stack, prompts[4]), timeout=10, poll=0.2) is not None


def _ok(stack, ids) -> bool:
    try:
        return generate(stack.gateway, request(ids, max_tokens=2), timeout=10)["finish_reason"] == "length"
    except grpc.RpcError:
        return False


def test_verifier_killed_ends_streams_unavailable_then_recovers(small_stack, prompts):
    codes: list = []
    started = threading.Barrier(3)

    def run(ids):
        ch, call = _stream(small_stack.gateway, request(ids, max_tokens=220, ignore_eos=True), timeout=60)
        try:
            next(call)
            started.wait(30)
            for _ in call:
                pass
            codes.append("finished")
        except grpc.RpcError as e:
            codes.append((e.code(), time.monotonic()))
        finally:
            ch.close()

    threads = [threading.Thread(target=run, args=(prompts[i],)) for i in (5, 6)]
    for t in threads:
        t.start()
    started.wait(30)
    verifier = small_stack["verifier"]
    verifier.kill9()
    killed_at = time.monotonic()
    for t in threads:
        t.join(30)
    assert len(codes) == 2
    for c in codes:
        assert c != "finished" and c[0] == grpc.StatusCode.UNAVAILABLE
        assert c[1] - killed_at < 3.0, "streams should end promptly"
    # New requests are refused with UNAVAILABLE while the verifier is down, fast.
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        generate(small_stack.gateway, request(prompts[7], max_tokens=4), timeout=20)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "verifier" in err.value.details()
    assert time.monotonic() - t0 < 5.0
    status, body = _completion(small_stack, prompts[7])
    assert status == 503 and body["error"]["type"] == "server_error" and "verifier" in body["error"]["message"]
    assert wait_for(lambda: _http(small_stack, "/health")[0] == 503, timeout=5, poll=0.1) is not None
    verifier.start()
    verifier.wait_serving()
    assert wait_for(lambda: _ok(small_stack, prompts[8]), timeout=20, poll=0.3) is not None
    assert wait_for(lambda: _http(small_stack, "/health")[0] == 200, timeout=5, poll=0.1) is not None
    assert _completion(small_stack, prompts[8])[0] == 200


def test_sigterm_drains(small_stack, prompts):
    """The module's last test: it stops the gateway."""
    gw = small_stack["gateway"]
    result: dict = {}

    def run():
        try:
            result["out"] = generate(small_stack.gateway, request(prompts[9], max_tokens=200, ignore_eos=True), timeout=60)
        except grpc.RpcError as e:
            result["error"] = e

    def run_http():  # queued behind the two gRPC streams (max_num_seqs 2) when the signal comes
        model = _http(small_stack, "/v1/models")[1]["data"][0]["id"]
        body = {"model": model, "prompt": list(prompts[12]), "max_tokens": 50, "temperature": 0,
                "ignore_eos": True, "stream": True}
        req = urllib.request.Request(f"http://127.0.0.1:{small_stack.http_port}/v1/completions",
                                     data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                result["http"] = r.read()
        except Exception as e:  # noqa: BLE001: reported by the assertion below
            result["http"] = repr(e).encode()

    ch, call = _stream(small_stack.gateway, request(prompts[10], max_tokens=200, ignore_eos=True))
    next(call)  # live before the signal
    t = threading.Thread(target=run)
    t.start()
    t_http = threading.Thread(target=run_http)
    t_http.start()
    time.sleep(0.3)
    gw.proc.send_signal(15)
    assert wait_for(lambda: health(gw.address) != "SERVING", timeout=5, poll=0.05) is not None
    with pytest.raises(grpc.RpcError) as err:
        generate(small_stack.gateway, request(prompts[11], max_tokens=4), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert _http(small_stack, "/health") == (503, {"status": "draining"})
    status, body = _completion(small_stack, prompts[11])
    assert status == 503 and "shutting down" in body["error"]["message"]
    tokens = 1
    last = None
    for msg in call:
        tokens += len(msg.token_ids)
        last = msg
    ch.close()
    assert last is not None and last.finish_reason == "length"
    t.join(60)
    assert "out" in result, result.get("error")
    assert result["out"]["finish_reason"] == "length"
    t_http.join(60)  # the HTTP stream, admitted during the drain, finishes too
    assert result["http"].endswith(b"data: [DONE]\n\n") and b'"finish_reason":"length"' in result["http"], result["http"][-300:]
    assert gw.proc.wait(30) == 0
    assert small_stack["verifier"].stop() == 0
