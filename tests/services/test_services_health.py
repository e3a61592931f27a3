"""Gateway health tells the truth (gRPC health and HTTP /health): NOT_SERVING while its step
thread is stuck; and the drain ends a request that is still being tokenized with UNAVAILABLE.
Real `specsplit serve` processes with a fault from tests/helpers/faulty_gateway.py (the
verifier's NOT_SERVING and a dead tensor-parallel worker: test_services_tensor_parallel.py; the
drain's health: test_services_verifier_down.py)."""
from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import grpc
import pytest

from tests.services.procs import HOST, TINY_ENGINE, ServiceProcess, free_port, health, request, wait_for
from specsplit.v1 import gateway_pb2_grpc


def _http_health(port: int) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://{HOST}:{port}/health", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture
def stuck_server(tmp_path, tiny_llama):
    port, http_port = free_port(), free_port()
    argv = ["serve", "--target", str(tiny_llama), "--draft", "none", "--port", str(port), "--http-port",
            str(http_port), "--stall-timeout", "2", "--drain-timeout", "2", *TINY_ENGINE]
    proc = ServiceProcess("stuck-serve", argv, tmp_path, port, env={"SPECSPLIT_FAULT_STALL_AFTER_STEPS": "3"},
                          module="tests.helpers.faulty_gateway")
    try:
        proc.wait_serving(240)
        proc.http_port = http_port
        yield proc
    finally:
        proc.stop()


def test_a_stuck_step_thread_turns_health_not_serving(stuck_server):
    assert _http_health(stuck_server.http_port) == (200, {"status": "ok"})
    codes = []

    def stream():
        with grpc.insecure_channel(stuck_server.address) as ch:
            try:
                for _ in gateway_pb2_grpc.GatewayStub(ch).Generate(request([5, 6, 7], max_tokens=100, ignore_eos=True),
                                                                   timeout=60):
                    pass
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as e:
                codes.append(e.code())

    t = threading.Thread(target=stream, daemon=True)
    t.start()
    # --stall-timeout 2, probed every second: well within 15 s of the step that hangs
    assert wait_for(lambda: health(stuck_server.address) == "NOT_SERVING", 15, poll=0.2) is not None, \
        stuck_server.log_tail()
    status, body = _http_health(stuck_server.http_port)
    assert status == 503 and "scheduler step has run for" in body["status"], body
    assert "NOT_SERVING: a scheduler step has run for" in stuck_server.log_tail()
    assert stuck_server.stop() == 0  # the drain gives up after --drain-timeout and ends the stream
    t.join(30)
    assert codes == [grpc.StatusCode.UNAVAILABLE]


def test_the_drain_ends_a_request_still_being_tokenized_unavailable(tmp_path, tiny_llama):
    """SIGTERM while a prompt is being tokenized (made slow: 3 s): the request ends UNAVAILABLE
    with a message (the drain waits for it; it was CANCELLED when the server stopped under it),
    and the server exits 0."""
    port = free_port()
    argv = ["serve", "--target", str(tiny_llama), "--draft", "none", "--port", str(port), "--drain-timeout", "20",
            *TINY_ENGINE]
    proc = ServiceProcess("slow-tokenizer", argv, tmp_path, port, env={"SPECSPLIT_FAULT_TOKENIZE_SECONDS": "3"},
                          module="tests.helpers.faulty_gateway")
    try:
        proc.wait_serving(240)
        result = []

        def stream():
            with grpc.insecure_channel(proc.address) as ch:
                try:
                    list(gateway_pb2_grpc.GatewayStub(ch).Generate(request(prompt="w5 w6 w7", max_tokens=4), timeout=60))
                    result.append((grpc.StatusCode.OK, ""))
                except grpc.RpcError as e:
                    result.append((e.code(), e.details()))

        t = threading.Thread(target=stream, daemon=True)
        t.start()
        assert wait_for(lambda: "TEST FAULT: tokenizing" in proc.log_tail(), 30, poll=0.05) is not None
        assert proc.stop() == 0, proc.log_tail()
        t.join(30)
        assert result and result[0][0] == grpc.StatusCode.UNAVAILABLE, (result, proc.log_tail())
        assert "shutting down" in result[0][1]
    finally:
        proc.stop()
