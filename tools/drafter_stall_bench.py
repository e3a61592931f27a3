"""Issue #24 item 1's goal, measured on a real split stack (`specsplit up`: drafter, verifier and
gateway on loopback, the real model): "drafter SIGSTOP for 20 s mid-stream: the stream's largest
inter-token gap <= 3x a target-only step; tokens equal target-only; speculation resumes after
SIGCONT".

  1. target-only: the greedy stream with speculation disabled (the reference tokens, and the
     target-only step: the median gap between its messages);
  2. stalled: the same stream speculating; once it has sent --stop-after tokens the drafter process
     is SIGSTOP'd for --stall-s seconds, then SIGCONT'd; the stream goes on to max_tokens.

Reported (JSON): the largest gap between messages from the SIGSTOP to the end, the target-only
step, their ratio, whether the tokens equal the reference, the drafts accepted after the SIGCONT
(the gateway's specsplit_draft_tokens_accepted_total) and the catch-up pieces it sent
(specsplit_drafter_catch_up_pieces_total).

    python tools/drafter_stall_bench.py --stall-s 20 --max-tokens 2400   # needs psutil (as the tests do)

Timing goals live here, never in tests (docs/testing.md).
"""
from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

import grpc
import psutil

from specsplit.defaults import resolve_draft
from specsplit.gateway.launch import specsplit_up
from specsplit.rpc.health import free_port_run
from specsplit.rpc.metrics import read_metrics
from specsplit.v1 import gateway_pb2, gateway_pb2_grpc


def _request(prompt: str, max_tokens: int, disable: bool) -> gateway_pb2.GenerateRequest:
    req = gateway_pb2.GenerateRequest(prompt=prompt, max_tokens=max_tokens, ignore_eos=True)
    req.speculation.disable = disable
    return req


def _stream(address: str, req, times: list, tokens: list) -> None:
    with grpc.insecure_channel(address) as ch:
        for m in gateway_pb2_grpc.GatewayStub(ch).Generate(req, timeout=900):
            if m.token_ids:
                times.append(time.perf_counter())
                tokens.extend(m.token_ids)


def _metric(port: int, name: str) -> float:
    return sum(v for key, v in read_metrics(port).items() if key.startswith(name))


def _drafter_process(up_pid: int, drafter_address: str) -> psutil.Process:
    """The child of `up` listening on the drafter's port."""
    port = int(drafter_address.rpartition(":")[2])
    for p in psutil.Process(up_pid).children(recursive=True):
        try:
            if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in p.net_connections("tcp")):
                return p
        except psutil.Error:
            continue
    raise RuntimeError(f"no child of `specsplit up` listens on {drafter_address}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--draft", default=None, help="default: the target's shipped draft")
    p.add_argument("--prompt", default="Write a long story about a lighthouse keeper and the sea.")
    p.add_argument("--max-tokens", type=int, default=2400)
    p.add_argument("--stop-after", type=int, default=64, help="tokens streamed before the SIGSTOP")
    p.add_argument("--stall-s", type=float, default=20.0)
    p.add_argument("--log", default="/tmp/drafter_stall_bench/up.log")
    p.add_argument("--extra", default="--max-model-len 4096", help="flags for `specsplit up`")
    a = p.parse_args(argv)
    draft = resolve_draft(a.target, a.draft)
    Path(a.log).parent.mkdir(parents=True, exist_ok=True)
    mport = free_port_run(3)  # the gateway's; the engines take the next two
    with specsplit_up(a.target, draft, log=a.log, log_level="INFO",
                      extra=[*a.extra.split(), "--metrics-port", str(mport)]) as up:
        _stream(up.address, _request(a.prompt, 16, disable=False), [], [])  # warm up
        ref_times: list[float] = []
        reference: list[int] = []
        _stream(up.address, _request(a.prompt, a.max_tokens, disable=True), ref_times, reference)
        step = statistics.median(b - a_ for a_, b in zip(ref_times, ref_times[1:]))

        drafter = _drafter_process(up.proc.pid, up.drafter)
        times: list[float] = []
        tokens: list[int] = []
        reader = threading.Thread(target=_stream, args=(up.address, _request(a.prompt, a.max_tokens, False),
                                                        times, tokens))
        reader.start()
        while len(tokens) < a.stop_after and reader.is_alive():
            time.sleep(0.005)
        accepted_before = _metric(mport, "specsplit_draft_tokens_accepted_total")
        drafter.send_signal(signal.SIGSTOP)
        stopped = time.perf_counter()
        try:
            reader.join(a.stall_s)
        finally:
            drafter.send_signal(signal.SIGCONT)
        resumed_at = time.perf_counter()
        at_sigcont = len(tokens)
        accepted_stall = _metric(mport, "specsplit_draft_tokens_accepted_total")
        reader.join(900)
        accepted_after = _metric(mport, "specsplit_draft_tokens_accepted_total")
        pieces = _metric(mport, "specsplit_drafter_catch_up_pieces_total")
        # what the drafter's deadline floor must cover: a step's gRPC time beyond the engines' (both peers)
        network = (_metric(mport, 'specsplit_step_seconds_sum{phase="network"}')
                   / max(1.0, _metric(mport, 'specsplit_step_seconds_count{phase="network"}')))
    gaps = [b - a_ for a_, b in zip(times, times[1:]) if b > stopped]
    stall_gaps = [b - a_ for a_, b in zip(times, times[1:]) if stopped < b <= resumed_at]
    after_gaps = [b - a_ for a_, b in zip(times, times[1:]) if b > resumed_at]
    worst = max(gaps)
    ref_gaps = [b - a_ for a_, b in zip(ref_times, ref_times[1:])]
    # where the largest gaps fell (seconds after the SIGSTOP; the SIGCONT came stall_s after it)
    top = sorted(((b - a_, b - stopped) for a_, b in zip(times, times[1:]) if b > stopped), reverse=True)[:5]
    print(json.dumps({
        "target": a.target, "draft": draft, "max_tokens": a.max_tokens, "stall_s": a.stall_s,
        "tokens_at_sigstop": a.stop_after, "tokens_at_sigcont": at_sigcont,
        "target_only_step_median_s": round(step, 4),
        "max_gap_after_sigstop_s": round(worst, 4), "ratio": round(worst / step, 2),
        # the machine's own noise: the target-only stream's largest gap and its ratio to its median
        "target_only_max_gap_s": round(max(ref_gaps), 4), "target_only_max_ratio": round(max(ref_gaps) / step, 2),
        "top_gaps_s_at_s_after_sigstop": [[round(g, 4), round(t, 2)] for g, t in top],
        "max_gap_while_stopped_s": round(max(stall_gaps), 4) if stall_gaps else None,
        "max_gap_after_sigcont_s": round(max(after_gaps), 4) if after_gaps else None,
        "tokens_equal_target_only": tokens == reference,
        "accepted_before_sigstop": accepted_before, "accepted_while_stopped": accepted_stall - accepted_before,
        "accepted_after_sigcont": accepted_after - accepted_stall, "catch_up_pieces": pieces,
        "network_s_per_step_mean": round(network, 5),
    }, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
