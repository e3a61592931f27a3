"""A transport that never blocks (gateway/service.py, gateway/scheduler_thread.py, gateway/app.py), on its
own verifier + gateway (real processes, loopback): a cancel is honoured while the step's verifier
RPC hangs (SIGSTOP), health follows the verifier, request_id is bounded, and a drain that times
out ends the streams it aborts with UNAVAILABLE.

No wall-clock assertions: the cancel test checks the order of events (the cancel is counted
while the verifier is still stopped, before any error could end that stream).
"""
from __future__ import annotations

import signal

import grpc
import pytest

from specsplit.v1 import gateway_pb2_grpc
from tests.services.procs import generate, health, request, scrape, service_info, start_split, wait_for


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_llama):
    s = start_split(tmp_path_factory.mktemp("transport-logs"), tiny_llama, None, max_num_seqs=4, max_queue=4,
                    gateway_extra=("--drain-timeout", "1"))
    try:
        yield s.ready()
    finally:
        v = s["verifier"]
        if v.alive():
            v.proc.send_signal(signal.SIGCONT)
        s.stop()


def _metric(stack, name: str) -> float:
    return scrape(stack["gateway"].metrics_port).get(name, 0.0)


CANCELLED = 'specsplit_requests_total{outcome="cancelled"}'
UNAVAILABLE = 'specsplit_requests_total{outcome="unavailable"}'


def test_request_id_is_bounded(stack, prompts):
    with pytest.raises(grpc.RpcError) as err:
        generate(stack.gateway, request(prompts[0], max_tokens=2, request_id="x" * 129), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "at most 128" in err.value.details()
    out = generate(stack.gateway, request(prompts[0], max_tokens=2, request_id="x" * 128), timeout=30)
    assert out["finish_reason"] == "length"


def test_cancel_is_honoured_while_the_verifier_rpc_hangs(stack, prompts):
    verifier = stack["verifier"]
    ch = grpc.insecure_channel(stack.gateway)
    call = gateway_pb2_grpc.GatewayStub(ch).Generate(request(prompts[1], max_tokens=200, ignore_eos=True), timeout=60)
    next(call)  # running
    cancelled, unavailable = _metric(stack, CANCELLED), _metric(stack, UNAVAILABLE)
    verifier.proc.send_signal(signal.SIGSTOP)  # the next step's verify hangs
    try:
        call.cancel()
        assert wait_for(lambda: _metric(stack, CANCELLED) == cancelled + 1, timeout=30, poll=0.02) is not None
        # Counted as cancelled, not ended by the hung RPC's failure: honoured while it was in flight.
        assert _metric(stack, UNAVAILABLE) == unavailable
        assert verifier.proc.poll() is None  # still stopped: the cancel did not wait for it
    finally:
        verifier.proc.send_signal(signal.SIGCONT)
        ch.close()
    # The sequence is released on the verifier once the step is over.
    assert wait_for(lambda: service_info(verifier.address, "verifier").num_running == 0, timeout=30, poll=0.2) is not None


def test_health_not_serving_while_the_verifier_is_unreachable(stack, prompts):
    gw, verifier = stack["gateway"], stack["verifier"]
    assert wait_for(lambda: health(gw.address) == "SERVING", timeout=30, poll=0.1) is not None
    verifier.proc.send_signal(signal.SIGSTOP)
    try:
        assert wait_for(lambda: health(gw.address) == "NOT_SERVING", timeout=30, poll=0.1) is not None
    finally:
        verifier.proc.send_signal(signal.SIGCONT)
    assert wait_for(lambda: health(gw.address) == "SERVING", timeout=30, poll=0.1) is not None
    assert generate(stack.gateway, request(prompts[2], max_tokens=2), timeout=30)["finish_reason"] == "length"


def test_drain_abort_ends_streams_unavailable(stack, prompts):
    """The module's last test: it stops the gateway. A stream still live when --drain-timeout (1 s)
    passes ends with UNAVAILABLE (it used to end with status OK and finish_reason abort)."""
    gw, verifier = stack["gateway"], stack["verifier"]
    ch = grpc.insecure_channel(stack.gateway)
    call = gateway_pb2_grpc.GatewayStub(ch).Generate(request(prompts[3], max_tokens=200, ignore_eos=True), timeout=60)
    next(call)
    verifier.proc.send_signal(signal.SIGSTOP)  # the stream cannot finish within the drain timeout
    try:
        gw.proc.send_signal(signal.SIGTERM)
        with pytest.raises(grpc.RpcError) as err:
            for _ in call:
                pass
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "drain timeout" in err.value.details()
    finally:
        verifier.proc.send_signal(signal.SIGCONT)
        ch.close()
    assert gw.proc.wait(30) == 0
