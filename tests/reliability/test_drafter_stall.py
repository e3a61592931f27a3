"""A hung drafter cannot stall the streams (#24 item 1): the drafter of a split stack is SIGSTOP'd
mid-stream (a frozen peer: TCP up, nothing answers). Each drafter call has a deadline derived from
what verifying costs (spec/decoder.py), not the gateway's --drafter-timeout (5 s here); after one
missed deadline the steps go on target-only without calling it while a probe runs off the step
thread, so the stream's tokens are the target's; after SIGCONT the drafter is re-synced, catches up
in bounded pieces (specsplit_drafter_catch_up_pieces_total) and speculation resumes, in the same
stream. Nothing leaks: every KV block of both engines is free after. The gaps themselves are
measured by tools/drafter_stall_bench.py, not asserted here."""
from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest

from specsplit.v1 import gateway_pb2_grpc
from tests.services.conftest import reference  # noqa: F401  (the target-only greedy tokens)
from tests.services.procs import generate, request, scrape, start_split, wait_for

MAX_GAP_S = 1.5  # was ~5 s per stall (the drafter timeout), then again at every re-sync attempt
MAX_TOKENS = 200
LONG_TOKENS = 250  # the catch-up test's stream: most of --max-model-len 256


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_llama, tiny_draft_close):
    s = start_split(tmp_path_factory.mktemp("drafter-stall"), tiny_llama, tiny_draft_close, max_num_seqs=4,
                    gateway_extra=("--drafter-timeout", "5", "--num-speculative-tokens", "3"))
    try:
        yield s.ready()
    finally:
        s.stop()


def test_sigstopped_drafter_leaves_short_gaps_and_the_targets_tokens(stack, prompts, reference):
    prompt = prompts[3]
    times: list[float] = []
    tokens: list[int] = []
    done = threading.Event()

    def run():
        with grpc.insecure_channel(stack.gateway) as ch:
            for msg in gateway_pb2_grpc.GatewayStub(ch).Generate(
                    request(prompt, max_tokens=MAX_TOKENS, ignore_eos=True), timeout=120):
                times.append(time.monotonic())
                tokens.extend(msg.token_ids)
        done.set()

    t = threading.Thread(target=run)
    t.start()
    assert wait_for(lambda: len(tokens) >= 10 or None, timeout=60, poll=0.01)
    drafter = stack["drafter"]
    drafter.proc.send_signal(signal.SIGSTOP)
    t_stop = time.monotonic()
    try:
        t.join(90)
    finally:
        drafter.proc.send_signal(signal.SIGCONT)
    assert done.is_set(), "the stream did not finish"
    after = [b - a for a, b in zip(times, times[1:]) if b > t_stop]
    print(f"FIGURE drafter stall: SIGSTOP'd drafter -> longest gap {max(after):.2f}s over {len(after)} messages "
          f"(drafter timeout 5 s; bound {MAX_GAP_S:g}s)")
    assert tokens == reference(prompt, MAX_TOKENS, ignore_eos=True)
    assert max(after) < MAX_GAP_S
    # the drafter answers again: it is re-synced and speculation resumes for new requests
    resumed = wait_for(lambda: generate(stack.gateway, request(prompt, max_tokens=24, ignore_eos=True))
                       ["usage"]["accepted_draft_tokens"] > 0 or None, timeout=30, poll=0.5)
    assert resumed is not None


def _metric(proc, name: str) -> float:
    return sum(v for k, v in scrape(proc.metrics_port).items() if k == name or k.startswith(name + "{"))


def _stream(address, req, tokens: list, done: threading.Event):
    with grpc.insecure_channel(address) as ch:
        for msg in gateway_pb2_grpc.GatewayStub(ch).Generate(req, timeout=120):
            tokens.extend(msg.token_ids)
    done.set()


def test_after_sigcont_the_drafter_catches_up_in_pieces_and_the_same_stream_speculates(stack, prompts, reference):
    prompt = prompts[1]
    gateway, drafter, verifier = stack["gateway"], stack["drafter"], stack["verifier"]
    tokens: list[int] = []
    done = threading.Event()
    t = threading.Thread(target=_stream, args=(stack.gateway, request(prompt, max_tokens=LONG_TOKENS, ignore_eos=True),
                                               tokens, done))
    t.start()
    assert wait_for(lambda: len(tokens) >= 10 or None, timeout=60, poll=0.01)
    drafter.proc.send_signal(signal.SIGSTOP)
    try:
        # target-only meanwhile: the context grows past several catch-up pieces (CATCH_UP_TOKENS)
        assert wait_for(lambda: len(tokens) >= 100 or done.is_set() or None, timeout=60, poll=0.005)
        assert not done.is_set()
        pieces_before = _metric(gateway, "specsplit_drafter_catch_up_pieces_total")
        accepted_before = _metric(gateway, "specsplit_draft_tokens_accepted_total")
    finally:
        drafter.proc.send_signal(signal.SIGCONT)
    t.join(90)
    assert done.is_set(), "the stream did not finish"
    assert tokens == reference(prompt, LONG_TOKENS, ignore_eos=True)
    # re-synced while the stream ran: its 100+-token context in pieces of at most CATCH_UP_TOKENS,
    # then drafts accepted again (the only stream running: they are this stream's)
    pieces = _metric(gateway, "specsplit_drafter_catch_up_pieces_total") - pieces_before
    accepted = _metric(gateway, "specsplit_draft_tokens_accepted_total") - accepted_before
    assert pieces >= 2, gateway.log_tail(60)
    assert accepted > 0, gateway.log_tail(60)
    assert "drafter is back" in gateway.log_tail(400)
    # nothing leaks: every KV block of both engines is free once the streams ended
    for proc in (drafter, verifier):
        assert wait_for(lambda: _used_blocks(proc) == 0 or None, timeout=30, poll=0.2), scrape(proc.metrics_port)


def _used_blocks(proc) -> float:
    return sum(v for k, v in scrape(proc.metrics_port).items()
               if k.startswith("specsplit_kv_blocks{") and 'state="used"' in k)
