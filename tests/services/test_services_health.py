"""Gateway health tells the truth (gRPC health and HTTP /health): NOT_SERVING while its step
thread is stuck, and while its verifier reports NOT_SERVING; and the drain ends a request that is
still being tokenized with UNAVAILABLE. Real processes, some with a fault from
tests/helpers/faulty_gateway.py (a dead tensor-parallel worker: test_services_tensor_parallel.py;
the drain's health: test_services_verifier_down.py)."""
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


def test_the_gateway_follows_a_verifier_that_reports_not_serving(tmp_path, tiny_llama):
    """A verifier that drains (SIGTERM while a long stream runs) still answers GetInfo, with
    serving false: the gateway turns NOT_SERVING while the verifier is still up (it stayed SERVING
    as long as the verifier answered at all)."""
    import signal

    from tests.services.procs import Stack

    long_engine = [*TINY_ENGINE, "--max-model-len", "512", "--max-num-seqs", "4"]  # the tiny model's 512 positions
    vport, gport = free_port(), free_port()
    stack = Stack()
    stack.procs["verifier"] = ServiceProcess("verifier", ["verifier", "--model", str(tiny_llama), "--port", str(vport),
                                                          "--drain-timeout", "60", *long_engine], tmp_path, vport)
    stack.procs["gateway"] = ServiceProcess("gateway", ["gateway", "--verifier", f"{HOST}:{vport}", "--port", str(gport),
                                                        "--max-num-seqs", "4", "--drain-timeout", "5"], tmp_path, gport)
    try:
        stack.ready()
        started, codes = [threading.Event() for _ in range(4)], []

        def stream(i):  # four long streams: the verifier's drain lasts as long as they run
            with grpc.insecure_channel(stack.gateway) as ch:
                try:
                    for _ in gateway_pb2_grpc.GatewayStub(ch).Generate(request([5 + i, 6, 7], max_tokens=500,
                                                                               ignore_eos=True), timeout=300):
                        started[i].set()
                    codes.append(grpc.StatusCode.OK)
                except grpc.RpcError as e:
                    codes.append(e.code())
                started[i].set()

        threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(4)]
        for t in threads:
            t.start()
        assert all(e.wait(60) for e in started) and not codes  # all four run before the drain begins
        verifier = stack["verifier"]
        verifier.proc.send_signal(signal.SIGTERM)  # drains: its running sequence goes on
        # NOT_SERVING while the verifier still runs the streams (not only once it stops answering)
        seen = wait_for(lambda: not codes and verifier.alive() and health(stack.gateway) == "NOT_SERVING", 20, poll=0.1)
        assert seen is not None, stack.logs()
        assert "the verifier reports NOT_SERVING" in stack["gateway"].log_tail()
        for t in threads:
            t.join(300)
        assert codes == [grpc.StatusCode.OK] * 4  # the drain let the live streams finish
    finally:
        stack.stop()


def test_a_verifier_restarted_with_smaller_limits_makes_the_gateway_exit(tmp_path, tiny_llama):
    """Issue #24 finding 13: the split gateway admits by the limits it read from the verifier at
    start. A verifier restarted with the same flags is served on; one restarted with a smaller
    --max-model-len would be over-admitted (requests it refuses), so the gateway reports
    NOT_SERVING and exits non-zero, for a supervisor to restart it with the new limits."""
    from tests.services.procs import generate, start_split

    stack = start_split(tmp_path, tiny_llama, None, max_num_seqs=4).ready()
    try:
        verifier, gateway = stack["verifier"], stack["gateway"]
        verifier.stop()
        verifier.start()
        verifier.wait_serving(240)

        def served() -> bool:
            try:
                return len(generate(stack.gateway, request([5, 6, 7], max_tokens=4), timeout=30)["token_ids"]) == 4
            except grpc.RpcError:  # the session of the verifier that stopped: lost once
                return False

        assert wait_for(served, 60, poll=0.5), stack.logs()
        assert wait_for(lambda: health(stack.gateway) == "SERVING", 10, poll=0.2), stack.logs()
        assert gateway.alive() and "smaller limits" not in gateway.log_tail(200)

        verifier.stop()
        verifier.argv = [*verifier.argv, "--max-model-len", "128"]  # TINY_ENGINE's is 256; the last one wins
        verifier.start()
        verifier.wait_serving(240)
        assert gateway.proc.wait(60) != 0, stack.logs()
        log = gateway.log_tail(200)
        assert "the verifier restarted with smaller limits" in log and "max_model_len 256 -> 128" in log, log
    finally:
        stack.stop()
