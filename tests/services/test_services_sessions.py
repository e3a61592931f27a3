"""Sessions on the engines are isolated: two gateways share one drafter and one verifier (a
normal N:1 deployment) without breaking each other, and a gateway that dies leaves nothing
behind. After every test, both engines hold no sequence and every KV block is free."""
from __future__ import annotations

import threading

import pytest

from tests.services.procs import HOST, DRAFTER_JOINS, SPECULATE_ALWAYS, ServiceProcess, free_port, generate, request, service_info, start_split, wait_for


@pytest.fixture(scope="module")
def shared_stack(tmp_path_factory, tiny_llama, tiny_draft_close):
    """drafter + verifier + gateway 'gateway', and a second gateway 'gateway2' on the same engines."""
    log_dir = tmp_path_factory.mktemp("sessions-logs")
    stack = start_split(log_dir, tiny_llama, tiny_draft_close)
    port = free_port()
    stack.procs["gateway2"] = ServiceProcess(
        "gateway2", ["gateway", "--verifier", stack["verifier"].address, "--drafter", stack["drafter"].address,
                     "--port", str(port), "--max-num-seqs", "8", "--drafter-timeout", "2", *DRAFTER_JOINS, *SPECULATE_ALWAYS],
        log_dir, port)
    try:
        yield stack.ready()
    finally:
        stack.procs.pop("gateway2").stop()
        stack.stop()


def _engines_empty(stack) -> bool:
    for role in ("drafter", "verifier"):
        info = service_info(stack[role].address, role)
        if info.num_running or info.kv.free_blocks != info.kv.num_blocks:
            return False
    return True


def _assert_engines_empty(stack) -> None:
    if wait_for(lambda: _engines_empty(stack), timeout=10.0) is None:
        infos = {r: service_info(stack[r].address, r) for r in ("drafter", "verifier")}
        raise AssertionError(f"sequences or blocks left behind: {infos}\n{stack.logs()}")


def _sampled(i: int, max_tokens: int = 24):
    return request(ids=[5 + i, 17, 33 + i, 8, 90], max_tokens=max_tokens, temperature=1.0, seed=100 + i, ignore_eos=True)


def test_two_gateways_share_one_drafter(shared_stack):
    addresses = [shared_stack.gateway, shared_stack["gateway2"].address]
    results: dict[tuple[int, int], dict] = {}
    errors: list[BaseException] = []

    def run(g: int, i: int):
        try:
            results[g, i] = generate(addresses[g], _sampled(i))
        except BaseException as e:  # noqa: BLE001  reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(g, i)) for i in range(6) for g in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert all(len(r["token_ids"]) == 24 for r in results.values())
    # Speculation really ran on both gateways, and neither lost its drafter to the other's step.
    assert all(r["usage"].get("proposed_draft_tokens", 0) > 0 for r in results.values())
    for name in ("gateway", "gateway2"):
        log = shared_stack[name].log_path.read_text(errors="replace")
        assert "drafter failed" not in log, shared_stack[name].log_tail()
    _assert_engines_empty(shared_stack)


def test_a_dead_gateway_frees_its_sequences(shared_stack):
    g2 = shared_stack["gateway2"]
    done = threading.Event()

    def long_request():
        try:
            generate(g2.address, _sampled(1, max_tokens=200), timeout=120)
        except Exception:  # noqa: BLE001  the gateway is killed under it
            pass
        finally:
            done.set()

    t = threading.Thread(target=long_request)
    t.start()
    assert wait_for(lambda: service_info(shared_stack["drafter"].address, "drafter").num_running > 0, 30.0) is not None
    g2.kill9()
    t.join(30)
    _assert_engines_empty(shared_stack)
    # The other gateway's sessions were untouched: it still speculates.
    out = generate(shared_stack.gateway, _sampled(2))
    assert len(out["token_ids"]) == 24 and out["usage"].get("proposed_draft_tokens", 0) > 0
    _assert_engines_empty(shared_stack)
    g2.start()
    g2.wait_serving()


def test_a_session_holds_at_most_max_num_seqs(shared_stack):
    import grpc

    from specsplit.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc

    def reqs():
        seqs = [common_pb2.SeqAdd(seq_id=f"x{i}", prompt_token_ids=[5, 6, 7]) for i in range(9)]
        yield drafter_pb2.DrafterRequest(id=1, add=common_pb2.AddSeqs(seqs=seqs))

    with grpc.insecure_channel(shared_stack["drafter"].address) as ch:
        (resp,) = list(drafter_pb2_grpc.DrafterStub(ch).Session(reqs(), timeout=30))
    assert resp.error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert "at most 8" in resp.error.message
    _assert_engines_empty(shared_stack)
