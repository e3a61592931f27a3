"""`specsplit verifier --tensor-parallel-size 2` as a real process (rank 0 + one worker, gloo) behind
a gateway with the n-gram drafter:

1. greedy streams equal the target alone (certified near-ties aside), concurrently; the verifier's
   plan lists both ranks; the streams that ask for logprobs get the target's (1e-4);
2. a worker killed with SIGKILL: the verifier turns NOT_SERVING, then exits with code 1; every open
   stream ends with UNAVAILABLE and the gateway's health is NOT_SERVING within 5 s; new requests
   fail UNAVAILABLE; no hang;
3. SIGTERM, and SIGKILL of the verifier itself, leave no worker process behind.
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import grpc
import pytest
import torch

from specsplit.v1 import gateway_pb2_grpc
from tests.helpers.logprobs import check_streamed_logprobs
from tests.helpers.orphans import assert_gone, tp_workers
from tests.services.procs import HOST, DRAFTER_JOINS, SPECULATE_ALWAYS, TINY_ENGINE, ServiceProcess, Stack, free_port, generate, health, \
    request, service_info, wait_for

ENDS_WITHIN_S = 5.0


def _verifier(log_dir, target, name="verifier") -> ServiceProcess:
    port = free_port()
    return ServiceProcess(name, ["verifier", "--model", str(target), "--port", str(port), "--max-num-seqs", "4",
                                 "--tensor-parallel-size", "2", *TINY_ENGINE], log_dir, port)


@pytest.fixture(scope="module")
def tp_stack(tmp_path_factory, tiny_llama):
    log_dir = tmp_path_factory.mktemp("tp-logs")
    stack = Stack()
    stack.procs["verifier"] = v = _verifier(log_dir, tiny_llama)
    dport, gport = free_port(), free_port()
    stack.procs["drafter"] = ServiceProcess("drafter", ["drafter", "--model", "ngram", "--port", str(dport), *TINY_ENGINE],
                                            log_dir, dport)
    stack.procs["gateway"] = ServiceProcess(
        "gateway", ["gateway", "--verifier", v.address, "--drafter", f"{HOST}:{dport}", "--port", str(gport),
                    "--max-num-seqs", "4", "--drain-timeout", "5", *DRAFTER_JOINS, *SPECULATE_ALWAYS], log_dir, gport)
    workers: list[int] = []
    try:
        stack.ready()
        workers = tp_workers(v.proc.pid)
        yield stack, workers
    finally:
        stack.stop()
        assert_gone(workers)


def test_tp2_greedy_equals_target_only_and_plan_lists_ranks(tp_stack, prompts, expect_greedy, tiny_llama):
    from transformers import AutoModelForCausalLM

    from specsplit.gateway.generate_client import collect

    stack, workers = tp_stack
    assert len(workers) == 1
    plan = json.loads(service_info(stack["verifier"].address, "verifier").memory_plan_json)
    assert plan["tensor_parallel"]["size"] == 2 and len(plan["tensor_parallel"]["ranks"]) == 2
    batch = prompts[:4]
    outs: list = [None] * len(batch)

    msgs: list = [None] * len(batch)

    def run(i):  # every other stream asks for logprobs: rank 0 scores them from the gathered logits
        with grpc.insecure_channel(stack.gateway) as ch:
            msgs[i] = list(gateway_pb2_grpc.GatewayStub(ch).Generate(
                request(batch[i], max_tokens=20, ignore_eos=True, logprobs=2 if i % 2 else None), timeout=60))
        outs[i] = collect(msgs[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(batch))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for ids, out in zip(batch, outs):
        expect_greedy(ids, out["token_ids"], 20, ignore_eos=True)
    assert sum(o["usage"]["proposed_draft_tokens"] for o in outs) > 0
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    for i, ids in enumerate(batch):
        if i % 2:
            check_streamed_logprobs(hf, ids, msgs[i], 2)
        else:
            assert all(len(m.logprobs) == 0 for m in msgs[i])


def test_worker_death_ends_streams_unavailable_within_5s(tp_stack, prompts):
    stack, workers = tp_stack
    results: list = [None] * 3
    started = threading.Barrier(len(results) + 1)

    def stream(i):
        ch = grpc.insecure_channel(stack.gateway)
        call = gateway_pb2_grpc.GatewayStub(ch).Generate(request(prompts[i], max_tokens=200, ignore_eos=True), timeout=60)
        code, msgs = "ok", 0
        try:
            for _ in call:
                msgs += 1
                if msgs == 1:
                    started.wait(30)
        except grpc.RpcError as e:
            code = e.code()
        finally:
            ch.close()
        if msgs == 0:
            started.wait(30)
        results[i] = (code, time.monotonic())

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(len(results))]
    for t in threads:
        t.start()
    started.wait(60)
    killed_at = time.monotonic()
    os.kill(workers[0], signal.SIGKILL)
    for t in threads:
        t.join(ENDS_WITHIN_S + 5)
    verifier = stack["verifier"]
    # The gateway follows: NOT_SERVING within 5 s of the kill (the verifier reports NOT_SERVING,
    # then exits), and stays so.
    assert wait_for(lambda: health(stack.gateway) == "NOT_SERVING", max(0.1, killed_at + ENDS_WITHIN_S - time.monotonic()),
                    poll=0.1) is not None, stack.logs()
    not_serving_s = time.monotonic() - killed_at
    for code, ended in results:
        assert code == grpc.StatusCode.UNAVAILABLE, (results, stack.logs())
        assert ended - killed_at < ENDS_WITHIN_S, results
    # The gateway may turn first (a health probe of the verifier timing out on a loaded machine): the
    # verifier's own health leaves SERVING within the same 5 s (at least 1 s after the gateway's).
    assert wait_for(lambda: health(verifier.address) != "SERVING",
                    max(1.0, killed_at + ENDS_WITHIN_S - time.monotonic()), poll=0.1) is not None, stack.logs()
    with pytest.raises(grpc.RpcError) as err:
        generate(stack.gateway, request(prompts[5], max_tokens=4), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    # A broken group is permanent: the verifier exits non-zero, so `restart: unless-stopped` (or any
    # supervisor) starts a fresh one.
    assert verifier.proc.wait(30) == 1, verifier.log_tail()
    exited_s = time.monotonic() - killed_at
    assert "cannot serve any more" in verifier.log_tail()
    assert health(stack.gateway) == "NOT_SERVING"
    # the figure (pytest -s): how long each took after the kill
    print(f"\nworker SIGKILL: streams ended UNAVAILABLE after {max(e for _, e in results) - killed_at:.2f} s, gateway "
          f"NOT_SERVING seen after {not_serving_s:.2f} s (polled every 0.1 s), verifier exited 1 after {exited_s:.2f} s")


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_no_worker_outlives_the_verifier(tmp_path, tiny_llama, how):
    v = _verifier(tmp_path, tiny_llama, f"verifier-{how}")
    try:
        v.wait_serving(180)
        workers = tp_workers(v.proc.pid)
        assert len(workers) == 1
        if how == "sigterm":
            assert v.stop() == 0
        else:
            v.kill9()  # the worker dies with its parent (PR_SET_PDEATHSIG)
        assert_gone(workers, within_s=10)
    finally:
        v.stop()


def test_serve_tp2_colocated_greedy_and_no_worker_left(tmp_path, tiny_llama, tiny_draft_close, prompts, expect_greedy):
    """`specsplit serve --tensor-parallel-size 2`: the colocated server with a 2-rank target and a
    model draft; greedy == target alone; the plan lists both ranks and the drafter; SIGTERM stops all."""
    port = free_port()
    serve = ServiceProcess("serve-tp", ["serve", "--target", str(tiny_llama), "--draft", str(tiny_draft_close),
                                        "--port", str(port), "--max-num-seqs", "4", "--tensor-parallel-size", "2",
                                        *TINY_ENGINE, *SPECULATE_ALWAYS], tmp_path, port)
    try:
        serve.wait_serving(180)
        workers = tp_workers(serve.proc.pid)
        assert len(workers) == 1
        outs = [generate(serve.address, request(ids, max_tokens=16, ignore_eos=True)) for ids in prompts[:3]]
        for ids, out in zip(prompts[:3], outs):
            expect_greedy(ids, out["token_ids"], 16, ignore_eos=True)
        assert sum(o["usage"]["accepted_draft_tokens"] for o in outs) > 0
        from tests.services.procs import server_info

        services = {s.name: json.loads(s.memory_plan_json) for s in server_info(serve.address).services}
        assert len(services["verifier"]["tensor_parallel"]["ranks"]) == 2 and "drafter" in services["verifier"]["services"]
        assert serve.stop() == 0
        assert_gone(workers)
    finally:
        serve.stop()


def test_up_passes_the_size_to_the_verifier_only():
    from specsplit.cli import build_parser
    from specsplit.cli.up import commands

    args = build_parser().parse_args(["up", "--target", "t", "--draft", "ngram", "--tensor-parallel-size", "2"])
    cmds = commands(args, 1, 2)
    v = cmds["verifier"]
    assert v[v.index("--tensor-parallel-size") + 1] == "2"
    assert "--tensor-parallel-size" not in cmds["drafter"] and "--tensor-parallel-size" not in cmds["gateway"]
    assert "--tensor-parallel-size" not in commands(build_parser().parse_args(["up", "--target", "t", "--draft", "ngram"]), 1, 2)["verifier"]


def test_serve_tp2_exits_non_zero_when_a_worker_dies(tmp_path, tiny_llama):
    """Colocated, too: a dead worker is permanent, so `serve` reports NOT_SERVING and exits with
    code 1 (a supervisor restarts it) instead of serving errors for ever."""
    port = free_port()
    serve = ServiceProcess("serve-tp-kill", ["serve", "--target", str(tiny_llama), "--draft", "none", "--port", str(port),
                                             "--tensor-parallel-size", "2", *TINY_ENGINE], tmp_path, port)
    try:
        serve.wait_serving(180)
        workers = tp_workers(serve.proc.pid)
        assert len(workers) == 1
        killed_at = time.monotonic()
        os.kill(workers[0], signal.SIGKILL)
        assert wait_for(lambda: health(serve.address) != "SERVING", ENDS_WITHIN_S, poll=0.1) is not None, serve.log_tail()
        assert serve.proc.wait(30) == 1, serve.log_tail()
        assert time.monotonic() - killed_at < 30
        assert "cannot serve any more" in serve.log_tail()
    finally:
        serve.stop()
