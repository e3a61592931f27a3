"""Bad input, cancellation, deadlines and a drafter killed mid-stream, against the tiny split stack.

(The module's last test kills the drafter and brings it back on the same port, leaving the
stack as it found it.)"""
from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from specsplit.v1 import gateway_pb2_grpc
from specsplit.cli.common import DEFAULT_K_MODEL
from tests.services.procs import generate, health, request, server_info, service_info, wait_for

INVALID = {
    "empty prompt": dict(prompt="", max_tokens=4),
    "too long": dict(ids=[5] * 250, max_tokens=10),
    "negative temperature": dict(ids=[5, 6], max_tokens=4, temperature=-0.5),
    "top_p negative": dict(ids=[5, 6], max_tokens=4, top_p=-0.1),
    "top_p above one": dict(ids=[5, 6], max_tokens=4, top_p=1.5),
    "id past vocab": dict(ids=[5, 256], max_tokens=4),
    "negative id": dict(ids=[5, -1], max_tokens=4),
    "zero max_tokens": dict(ids=[5, 6], max_tokens=0),
    "negative top_k": dict(ids=[5, 6], max_tokens=4, top_k=-2),
}


def _free_blocks(stack) -> tuple[int, int]:
    return (service_info(stack["verifier"].address, "verifier").kv.free_blocks,
            service_info(stack["drafter"].address, "drafter").kv.free_blocks)


def _running(stack) -> tuple[int, int]:
    return (service_info(stack["verifier"].address, "verifier").num_running,
            service_info(stack["drafter"].address, "drafter").num_running)


def _assert_nothing_left(stack) -> None:
    """No sequence on either engine and every KV block free (also the ones of sequences that
    finished while the drafter was unreachable)."""
    def idle():
        infos = [service_info(stack[r].address, r) for r in ("verifier", "drafter")]
        return all(i.num_running == 0 and i.kv.free_blocks == i.kv.num_blocks for i in infos)

    assert wait_for(idle, 10.0) is not None, (_running(stack), _free_blocks(stack))


def test_health_serving_everywhere(split_stack, colocated_stack):
    for p in list(split_stack.procs.values()) + list(colocated_stack.procs.values()):
        assert health(p.address) == "SERVING", p.name
    from specsplit.cli.health import check

    assert check(split_stack.gateway, "specsplit.v1.Gateway") == "SERVING"
    assert check(split_stack["verifier"].address, "specsplit.v1.Verifier") == "SERVING"
    assert check(split_stack["drafter"].address, "specsplit.v1.Drafter") == "SERVING"


def test_reflection_lists_services(split_stack):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    for name, service in [("gateway", "specsplit.v1.Gateway"), ("verifier", "specsplit.v1.Verifier"),
                          ("drafter", "specsplit.v1.Drafter")]:
        with grpc.insecure_channel(split_stack[name].address) as ch:
            stub = reflection_pb2_grpc.ServerReflectionStub(ch)
            (resp,) = list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5))
        names = {s.name for s in resp.list_services_response.service}
        assert service in names and "grpc.health.v1.Health" in names


@pytest.mark.parametrize("case", list(INVALID))
def test_invalid_request_is_invalid_argument_and_allocates_nothing(split_stack, case):
    before = _free_blocks(split_stack)
    with pytest.raises(grpc.RpcError) as err:
        generate(split_stack.gateway, request(**INVALID[case]), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert err.value.details()  # a message a person can act on
    assert _free_blocks(split_stack) == before
    assert _running(split_stack) == (0, 0)


def test_server_info_reports_models_k_and_plans(split_stack, colocated_stack):
    info = server_info(split_stack.gateway)
    assert info.mode == "split" and info.num_speculative_tokens == DEFAULT_K_MODEL and info.drafter_up
    names = {s.name: s for s in info.services}
    assert set(names) == {"verifier", "drafter"}
    for s in names.values():
        assert s.reachable and s.kv.paged and s.kv.num_blocks > 0
        plan = json.loads(s.memory_plan_json)
        assert plan["services"][s.name]["num_blocks"] == s.kv.num_blocks
    colo = server_info(colocated_stack.gateway)
    assert colo.mode == "colocated" and {s.name for s in colo.services} == {"verifier", "drafter"}
    assert json.loads(colo.services[0].memory_plan_json)["joint"] is True


def _open_stream(address, req, timeout=60):
    ch = grpc.insecure_channel(address)
    call = gateway_pb2_grpc.GatewayStub(ch).Generate(req, timeout=timeout)
    return ch, call


def test_cancel_frees_kv_on_both_services_within_a_second(split_stack, prompts):
    start = _free_blocks(split_stack)
    ch, call = _open_stream(split_stack.gateway, request(prompts[0], max_tokens=200, ignore_eos=True))
    first = next(call)
    assert first.token_ids
    assert _running(split_stack) == (1, 1)
    call.cancel()
    took = wait_for(lambda: _running(split_stack) == (0, 0), timeout=5.0)
    ch.close()
    assert took is not None, "the cancelled sequence was never released"
    assert took < 1.0, f"release took {took:.2f}s"
    assert _free_blocks(split_stack) == start


def test_deadline_frees_kv(split_stack, prompts):
    start = _free_blocks(split_stack)
    with pytest.raises(grpc.RpcError) as err:
        generate(split_stack.gateway, request(prompts[1], max_tokens=230, ignore_eos=True), timeout=0.5)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_for(lambda: _running(split_stack) == (0, 0), timeout=1.5) is not None
    assert _free_blocks(split_stack) == start


def test_twenty_streams_five_cancelled(split_stack, prompts, reference, expect_greedy):
    """More streams than max_num_seqs (8): the rest queue. Cancel 5 running ones mid-way; the other
    15 complete exactly, and every KV block comes back on both services."""
    start = _free_blocks(split_stack)
    n_tokens = 32
    cancel_idx = {0, 3, 6, 9, 12}
    results: dict[int, dict | str] = {}

    def run(i: int):
        ids = prompts[i]
        if i in cancel_idx:
            ch, call = _open_stream(split_stack.gateway, request(ids, max_tokens=200, ignore_eos=True))
            got = 0
            for msg in call:
                got += len(msg.token_ids)
                if got >= 4:
                    call.cancel()
                    break
            ch.close()
            results[i] = "cancelled"
        else:
            results[i] = generate(split_stack.gateway, request(ids, max_tokens=n_tokens, ignore_eos=True), timeout=120)

    with ThreadPoolExecutor(20) as pool:
        list(pool.map(run, range(20)))
    for i in range(20):
        if i in cancel_idx:
            assert results[i] == "cancelled"
        else:
            expect_greedy(prompts[i], results[i]["token_ids"], n_tokens, ignore_eos=True)
            assert results[i]["finish_reason"] == "length"
    assert wait_for(lambda: _running(split_stack) == (0, 0), timeout=5.0) is not None
    assert _free_blocks(split_stack) == start


def test_metrics_on_every_service(split_stack, prompts):
    from tests.services.procs import scrape

    generate(split_stack.gateway, request(prompts[2], max_tokens=12, ignore_eos=True))
    gw = scrape(split_stack["gateway"].metrics_port)
    assert gw['specsplit_requests_total{outcome="length"}'] >= 1
    assert gw["specsplit_generation_tokens_total"] >= 12 and gw["specsplit_prompt_tokens_total"] >= len(prompts[2])
    assert gw["specsplit_draft_tokens_proposed_total"] >= gw["specsplit_draft_tokens_accepted_total"] > 0
    assert gw['specsplit_draft_position_proposed_total{position="0"}'] >= gw['specsplit_draft_position_accepted_total{position="0"}']
    for phase in ("draft", "verify", "network", "total"):
        assert gw[f'specsplit_step_seconds_count{{phase="{phase}"}}'] > 0, phase
    assert 'specsplit_sequences{service="gateway",state="running"}' in gw
    assert 'specsplit_sequences{service="gateway",state="waiting"}' in gw
    assert not any(k.endswith("_created") for k in gw)
    for role in ("verifier", "drafter"):
        m = scrape(split_stack[role].metrics_port)
        info = service_info(split_stack[role].address, role)
        assert m[f'specsplit_kv_blocks{{service="{role}",state="free"}}'] == info.kv.free_blocks
        assert m[f'specsplit_kv_blocks{{service="{role}",state="used"}}'] == info.kv.num_blocks - info.kv.free_blocks
        assert any(k.startswith("specsplit_engine_seconds_count") for k in m)

def test_drafter_hung_streams_go_on_target_only(split_stack, prompts, reference, expect_greedy):
    """SIGSTOP the drafter mid-stream: its calls miss their 2 s deadline, the streams go on
    target-only with the same tokens; after SIGCONT the gateway speculates again."""
    import os
    import signal as sig

    drafter = split_stack["drafter"]
    n_tokens = 120
    ch, call = _open_stream(split_stack.gateway, request(prompts[13], max_tokens=n_tokens, ignore_eos=True), timeout=120)
    tokens = list(next(call).token_ids)
    os.kill(drafter.proc.pid, sig.SIGSTOP)
    try:
        t0 = time.monotonic()
        for msg in call:
            tokens.extend(msg.token_ids)
        took = time.monotonic() - t0
    finally:
        os.kill(drafter.proc.pid, sig.SIGCONT)
        ch.close()
    expect_greedy(prompts[13], tokens, n_tokens, ignore_eos=True)
    assert took < 30, f"a hung drafter held the stream up for {took:.1f}s"
    deadline = time.monotonic() + 40
    proposed = 0
    while proposed == 0 and time.monotonic() < deadline:
        out = generate(split_stack.gateway, request(prompts[19], max_tokens=24, ignore_eos=True))
        expect_greedy(prompts[19], out["token_ids"], 24, ignore_eos=True)
        proposed = out["usage"]["proposed_draft_tokens"]
        time.sleep(0.5)
    assert proposed > 0, "no speculation after the drafter woke up"
    _assert_nothing_left(split_stack)

def test_drafter_killed_mid_stream_then_back(split_stack, prompts, reference, expect_greedy):
    """kill -9 the drafter while 4 streams run: they finish target-only with the same greedy tokens;
    once the drafter is back on its port, the gateway speculates again."""
    n_tokens = 160
    batch = prompts[14:18]
    started = threading.Barrier(len(batch) + 1)
    outs: dict[int, dict] = {}

    def run(i, ids):
        ch, call = _open_stream(split_stack.gateway, request(ids, max_tokens=n_tokens, ignore_eos=True), timeout=180)
        msgs = [next(call)]
        started.wait(30)
        msgs.extend(call)
        ch.close()
        from specsplit.gateway.generate_client import collect

        outs[i] = collect(msgs)

    threads = [threading.Thread(target=run, args=(i, ids)) for i, ids in enumerate(batch)]
    for t in threads:
        t.start()
    started.wait(60)
    drafter = split_stack["drafter"]
    drafter.kill9()
    for t in threads:
        t.join(180)
    try:
        for i, ids in enumerate(batch):
            expect_greedy(ids, outs[i]["token_ids"], n_tokens, ignore_eos=True)
            assert outs[i]["finish_reason"] == "length"
        assert not server_info(split_stack.gateway).drafter_up
        assert server_info(split_stack.gateway).services[1].reachable is False
        # A request with no drafter at all still works.
        out = generate(split_stack.gateway, request(prompts[18], max_tokens=16, ignore_eos=True))
        expect_greedy(prompts[18], out["token_ids"], 16, ignore_eos=True)
        assert out["usage"]["proposed_draft_tokens"] == 0
    finally:
        drafter.start()  # same port
        drafter.wait_serving()
    proposed = 0
    deadline = time.monotonic() + 30
    while proposed == 0 and time.monotonic() < deadline:
        out = generate(split_stack.gateway, request(prompts[19], max_tokens=24, ignore_eos=True))
        expect_greedy(prompts[19], out["token_ids"], 24, ignore_eos=True)
        proposed = out["usage"]["proposed_draft_tokens"]
    assert proposed > 0, "the gateway never speculated again after the drafter came back"
    assert server_info(split_stack.gateway).drafter_up
    _assert_nothing_left(split_stack)

