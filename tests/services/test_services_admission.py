"""Requests refused before any work, with a message: a full gateway refuses a request before
tokenizing it (RESOURCE_EXHAUSTED / 429 with what to do), the gRPC API caps the calls open at once
(--max-concurrent-rpcs) and the HTTP API its connections (--http-limit-concurrency); a request
whose strings are not UTF-8 is INVALID_ARGUMENT / 400. A real `specsplit serve` (tiny target, no
draft) with room for one running and one queued request."""
from __future__ import annotations

import json
import socket
import threading
import urllib.error
import urllib.request

import grpc
import pytest

from grpc_health.v1 import health_pb2, health_pb2_grpc

from specsplit.v1 import gateway_pb2, gateway_pb2_grpc
from tests.services.procs import HOST, TINY_ENGINE, ServiceProcess, free_port, http_call, request, wait_for


@pytest.fixture(scope="module")
def full_server(tmp_path_factory, tiny_llama):
    root = tmp_path_factory.mktemp("admission")
    port, http_port = free_port(), free_port()
    argv = ["serve", "--target", str(tiny_llama), "--draft", "none", "--port", str(port), "--http-port", str(http_port),
            "--max-num-seqs", "1", "--max-queue", "1", "--max-concurrent-rpcs", "2", "--http-limit-concurrency", "2",
            "--drain-timeout", "2", *TINY_ENGINE]
    proc = ServiceProcess("admission-serve", argv, root, port)
    try:
        proc.wait_serving(240)
        proc.http_port = http_port
        proc.model = str(tiny_llama)
        yield proc
    finally:
        proc.stop()


def _http(srv, path: str, body: dict | None = None) -> tuple[int, str]:
    status, raw = http_call(srv.http_port, path, body, host=HOST)
    return status, raw.decode()


def _waiting(srv) -> float:
    text = _http(srv, "/metrics")[1]
    line = next((x for x in text.splitlines() if x.startswith('specsplit_sequences{service="gateway",state="waiting"}')), None)
    return float(line.rpartition(" ")[2]) if line else 0.0


def _long_stream(srv, first: threading.Event, out: list) -> None:
    with grpc.insecure_channel(srv.address) as ch:
        try:
            for _ in gateway_pb2_grpc.GatewayStub(ch).Generate(request([5, 6, 7], max_tokens=240, ignore_eos=True),
                                                               timeout=120):
                first.set()
            out.append(grpc.StatusCode.OK)
        except grpc.RpcError as e:
            out.append(e.code())
        first.set()


def test_a_full_server_refuses_before_tokenizing_and_caps_open_calls(full_server):
    srv = full_server
    results: list = []
    running, queued = threading.Event(), threading.Event()
    a = threading.Thread(target=_long_stream, args=(srv, running, results), daemon=True)
    a.start()
    assert running.wait(60)
    b = threading.Thread(target=_long_stream, args=(srv, queued, results), daemon=True)
    b.start()
    assert wait_for(lambda: _waiting(srv) == 1.0, 30, poll=0.05) is not None  # 1 running + 1 queued: full
    try:
        # Two gRPC calls are open (the streams): a third is refused before any handler runs.
        with grpc.insecure_channel(srv.address) as ch, pytest.raises(grpc.RpcError) as err:
            gateway_pb2_grpc.GatewayStub(ch).GetServerInfo(gateway_pb2.GetServerInfoRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-concurrent-rpcs 2" in err.value.details(), err.value.details()
        # Chat messages to a target without a chat template: tokenizing would be INVALID_ARGUMENT
        # (400). 429 shows the full server refused it before tokenizing, with what to do.
        status, body = _http(srv, "/v1/chat/completions",
                             {"model": srv.model, "messages": [{"role": "user", "content": "w5"}], "max_tokens": 2})
        message = json.loads(body)["error"]["message"]
        assert status == 429 and "the server is full" in message and "retry later" in message, body
        status, body = _http(srv, "/v1/completions", {"model": srv.model, "prompt": "w5 w6", "max_tokens": 2})
        assert status == 429, body
        # The HTTP API: with one connection open (idle), a second is over --http-limit-concurrency 2.
        with socket.create_connection((HOST, srv.http_port), timeout=10):
            assert wait_for(lambda: _http(srv, "/health")[0] == 503, 10, poll=0.1) is not None
        assert wait_for(lambda: _http(srv, "/health")[0] == 200, 10, poll=0.1) is not None
    finally:
        a.join(120)
        b.join(120)
    assert results == [grpc.StatusCode.OK, grpc.StatusCode.OK]
    # Free again: a request that needs the tokenizer is now tokenized (and refused by it: no template).
    status, body = _http(srv, "/v1/chat/completions",
                         {"model": srv.model, "messages": [{"role": "user", "content": "w5"}], "max_tokens": 2})
    assert status == 400 and "chat template" in body, body


def _over_limit(e: grpc.RpcError) -> bool:
    return e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-concurrent-rpcs" in (e.details() or "")


def _admitted(fn):
    """fn()'s result, or the RpcError it ended with, once the server takes the call (a slot given
    back by a call that just ended may take a moment to be free)."""
    out = []

    def attempt() -> bool:
        try:
            out.append(fn())
        except grpc.RpcError as e:
            if _over_limit(e):
                return False
            out.append(e)
        return True

    assert wait_for(attempt, 30, poll=0.1) is not None
    return out[0]


def _watch(ch):
    """A health Watch stream (open until cancelled, counted like any call) once it has answered."""
    call = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=""), timeout=120)
    try:
        next(call)
    except grpc.RpcError:
        call.cancel()
        raise
    return call


def _hold(ch, n: int) -> list:
    """n open calls (the server takes them all, or none is left open and the error is raised)."""
    calls = []
    try:
        for _ in range(n):
            calls.append(_watch(ch))
    except grpc.RpcError:
        for c in calls:
            c.cancel()
        raise
    return calls


def _info(ch):
    return gateway_pb2_grpc.GatewayStub(ch).GetServerInfo(gateway_pb2.GetServerInfoRequest(), timeout=10)


def test_every_ended_call_gives_its_slot_back(full_server):
    """--max-concurrent-rpcs 2: calls that end every way (refused over the limit, cancelled by the
    client, past their deadline, failed, finished) give their slot back; afterwards the server
    takes exactly 2 open calls again, and the third is refused naming the limit and the flag."""
    with grpc.insecure_channel(full_server.address) as ch:
        for _ in range(3):  # take both slots, be refused many times, cancel
            calls = _admitted(lambda: _hold(ch, 2))
            for _ in range(10):
                with pytest.raises(grpc.RpcError) as err:
                    _info(ch)
                assert _over_limit(err.value), err.value
                assert "--max-concurrent-rpcs 2" in err.value.details() and "retry later" in err.value.details()
            for c in calls:
                c.cancel()
        for _ in range(5):  # cancelled mid-stream
            _admitted(lambda: _watch(ch)).cancel()

        def past_deadline():  # answers SERVICE_UNKNOWN, then waits for a change until the deadline
            list(health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service="nope"), timeout=0.5))

        for _ in range(3):
            err = _admitted(past_deadline)
            assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err
            err = _admitted(lambda: list(gateway_pb2_grpc.GatewayStub(ch).Generate(  # no prompt
                gateway_pb2.GenerateRequest(max_tokens=2), timeout=30)))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
            out = _admitted(lambda: list(gateway_pb2_grpc.GatewayStub(ch).Generate(
                request([5, 6], max_tokens=2, ignore_eos=True), timeout=60)))
            assert sum(len(r.token_ids) for r in out) == 2, out
        # Exactly the limit again: two open calls are taken, a third is refused; then free.
        calls = _admitted(lambda: _hold(ch, 2))
        with pytest.raises(grpc.RpcError) as err:
            _info(ch)
        assert _over_limit(err.value), err.value
        for c in calls:
            c.cancel()
        assert _admitted(lambda: _info(ch)).max_num_seqs == 1


def _raw_generate(srv, payload: bytes) -> grpc.RpcError:
    """Generate with a hand-made request body (bytes as they go on the wire)."""
    with grpc.insecure_channel(srv.address) as ch:
        call = ch.unary_stream("/specsplit.v1.Gateway/Generate", request_serializer=lambda b: b,
                               response_deserializer=gateway_pb2.GenerateResponse.FromString)
        with pytest.raises(grpc.RpcError) as err:
            list(call(payload, timeout=30))
    return err.value


@pytest.mark.parametrize("field", ["prompt", "request_id", "stop"])
def test_invalid_utf8_is_invalid_argument(full_server, field):
    """A string field holding bytes that are not UTF-8: INVALID_ARGUMENT naming the problem (gRPC
    itself answers INTERNAL "Exception deserializing request!"); the server serves on."""
    placeholder = "QQQQ"
    msg = gateway_pb2.GenerateRequest(max_tokens=2, prompt="w5 w6")
    if field == "stop":
        msg.stop.append(placeholder)
    else:
        setattr(msg, field, placeholder)
    payload = msg.SerializeToString().replace(placeholder.encode(), b"\xff\xfe\xc3\x28")
    err = _raw_generate(full_server, payload)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    assert "must be valid UTF-8" in err.details()
    with grpc.insecure_channel(full_server.address) as ch:
        out = list(gateway_pb2_grpc.GatewayStub(ch).Generate(request([5, 6], max_tokens=2, ignore_eos=True), timeout=60))
    assert sum(len(r.token_ids) for r in out) == 2


def test_lone_surrogates_over_http_are_400(full_server):
    for path, body, param in [
        ("/v1/completions", '{"model": "%s", "prompt": "w5 \\ud800", "max_tokens": 2}', "prompt"),
        ("/v1/chat/completions", '{"model": "%s", "messages": [{"role": "user", "content": "\\udc00"}], "max_tokens": 2}',
         "messages"),
    ]:
        req = urllib.request.Request(f"http://{HOST}:{full_server.http_port}{path}",
                                     data=(body % full_server.model).encode(), headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=30)
        error = json.loads(err.value.read())["error"]
        assert err.value.code == 400 and "not valid UTF-8" in error["message"] and error["param"] == param, error
