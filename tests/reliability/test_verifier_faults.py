"""The verifier failing under the gateway, on the `faulty` stack (verifier + gateway):

1. the fault wrapper tests/helpers/faulty_verifier.py (SPECSPLIT_FAULT_VERIFY_AFTER_STEPS / _SECONDS) makes every verify
   fail after N steps for a few seconds: every in-flight stream ends with UNAVAILABLE within 5 s,
   new requests fail fast until the verifier recovers, then they succeed; nothing hangs.
2. keepalive: the verifier SIGSTOP'd mid-stream (a frozen peer: TCP stays up, nothing answers)
   ends every stream with UNAVAILABLE within keepalive time + timeout (1 s + 2 s here), far
   below --verifier-timeout (120 s); after SIGCONT the gateway serves again.
"""
from __future__ import annotations

import signal
import threading
import time

import grpc

from specsplit.v1 import gateway_pb2_grpc
from tests.reliability.conftest import FAULT_SECONDS
from tests.services.procs import generate, request, service_info, wait_for

ENDS_WITHIN_S = 5.0
KEEPALIVE_BOUND_S = 6.0  # 1 s ping interval + 2 s ping timeout + a step and scheduling slack


def _open_streams(address, prompts, n, max_tokens=220):
    """n streams in threads; each records (code or 'ok', t_last_message, t_end, messages)."""
    out: list = [None] * n
    started = threading.Barrier(n + 1)

    def run(i):
        ch = grpc.insecure_channel(address)
        call = gateway_pb2_grpc.GatewayStub(ch).Generate(request(prompts[i], max_tokens=max_tokens, ignore_eos=True), timeout=90)
        last, msgs, code = None, 0, "ok"
        try:
            for _ in call:
                msgs += 1
                last = time.monotonic()
                if msgs == 1:
                    started.wait(30)
        except grpc.RpcError as e:
            code = e.code()
        finally:
            ch.close()
        if msgs == 0:
            started.wait(30)
        out[i] = (code, last, time.monotonic(), msgs)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    started.wait(60)
    return threads, out


def _ok(stack, ids) -> bool:
    try:
        return generate(stack.gateway, request(ids, max_tokens=3, ignore_eos=True), timeout=10)["finish_reason"] == "length"
    except grpc.RpcError:
        return False


def test_verify_fault_ends_streams_then_recovers(faulty_stack, prompts):
    threads, out = _open_streams(faulty_stack.gateway, prompts, 4)
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a stream hung"
    gaps = [end - last for _, last, end, _ in out]
    print(f"FIGURE verify fault: {len(out)} streams ended with {sorted({c.name for c, *_ in out})} "
          f"{max(gaps):.2f}s (max) after their last token; messages {[m for *_, m in out]}")
    assert all(c == grpc.StatusCode.UNAVAILABLE for c, *_ in out), out
    assert max(gaps) < ENDS_WITHIN_S
    # Refused (fast) while failing...
    t0 = time.monotonic()
    try:
        generate(faulty_stack.gateway, request(prompts[5], max_tokens=3), timeout=10)
        refused = None
    except grpc.RpcError as e:
        refused = e.code()
    refuse_s = time.monotonic() - t0
    # ... then served again once it recovers.
    recovered = wait_for(lambda: _ok(faulty_stack, prompts[6]), timeout=FAULT_SECONDS + 15, poll=0.3)
    print(f"FIGURE verify fault: new request during the fault -> {refused and refused.name} in {refuse_s:.2f}s; "
          f"served again after {recovered}s")
    assert refused == grpc.StatusCode.UNAVAILABLE and refuse_s < ENDS_WITHIN_S
    assert recovered is not None
    assert faulty_stack["gateway"].alive() and faulty_stack["verifier"].alive()
    assert wait_for(lambda: service_info(faulty_stack["verifier"].address, "verifier").num_running == 0, 5) is not None


def test_sigstopped_verifier_detected_by_keepalive(faulty_stack, prompts):
    verifier = faulty_stack["verifier"]
    threads, out = _open_streams(faulty_stack.gateway, prompts, 3)
    time.sleep(0.3)
    verifier.proc.send_signal(signal.SIGSTOP)
    t_stop = time.monotonic()
    try:
        for t in threads:
            t.join(KEEPALIVE_BOUND_S + 20)
        hung = any(t.is_alive() for t in threads)
    finally:
        verifier.proc.send_signal(signal.SIGCONT)
    assert not hung, "a stream outlived the keepalive bound by 20 s"
    detect = max(end for _, _, end, _ in out) - t_stop
    print(f"FIGURE keepalive: SIGSTOP'd verifier -> {len(out)} streams ended with "
          f"{sorted({c.name if hasattr(c, 'name') else c for c, *_ in out})} within {detect:.2f}s "
          f"(bound {KEEPALIVE_BOUND_S:g}s; --keepalive-time 1 --keepalive-timeout 2)")
    assert all(c in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) for c, *_ in out), out
    assert detect < KEEPALIVE_BOUND_S
    recovered = wait_for(lambda: _ok(faulty_stack, prompts[7]), timeout=20, poll=0.3)
    print(f"FIGURE keepalive: served again {recovered}s after SIGCONT")
    assert recovered is not None
