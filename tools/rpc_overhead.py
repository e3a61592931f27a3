"""What one engine call costs over gRPC: the same engine in this process and as a service, interleaved.

    PYTHONPATH=. python tools/rpc_overhead.py --role verifier      # one decode row per call
    PYTHONPATH=. python tools/rpc_overhead.py --role drafter       # smollm2-135m-eagle3, 2 feature rows, K = 2

A service (`specsplit verifier` / `specsplit drafter`, one torch thread, pinned to one CPU) and the
same engine built in this process take the same calls, sequence by sequence, alternating which goes
first: a 300-token prompt, then 64 steps. In-process, this process runs on the service's CPU; over
gRPC it runs on another, as a gateway would. Printed: the median in-process call, the median round
trip through `gateway.peer_clients` and, of that, what the service measured around its engine call
(`compute_s`: the engine, the executor hop and the messages). Needs two CPUs.

A verifier step is a target-only decode (no drafts); a drafter step, as in lockstep speculation:
the 2 tokens a step emitted and the target's features of 2 positions (random numbers: the cost does
not depend on them), then K = 2 drafts.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.services.procs import ServiceProcess, free_port  # noqa: E402

TARGET, HEAD = "smollm2-135m", "smollm2-135m-eagle3"
PROMPT, STEPS, K = 300, 64, 2


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", choices=("verifier", "drafter"), default="verifier")
    ap.add_argument("--reps", type=int, default=10, help="sequences per side (each a prompt and 64 steps)")
    args = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        print("rpc_overhead needs two CPUs: the service's and the caller's", file=sys.stderr)
        return 2
    service_cpu, caller_cpu = cpus[0], cpus[1]

    import torch

    from gateway.peer_clients import GrpcDrafter, GrpcVerifier
    from specsplit.protocols import ProposeRequest, SeqAdd, VerifyRequest

    torch.set_num_threads(1)
    port = free_port()
    model = TARGET if args.role == "verifier" else HEAD
    engine_argv = [args.role, "--model", model, "--threads", "1", "--max-model-len", "1024"]  # both sides
    with tempfile.TemporaryDirectory(prefix="rpc-overhead-") as logs:
        service = ServiceProcess(args.role, [*engine_argv, "--port", str(port)], Path(logs), port).serving(600)
        try:
            os.system(f"taskset -a -pc {service_cpu} {service.proc.pid} > /dev/null")
            if args.role == "verifier":
                from rpc.build import build_engine
                from specsplit.cli import build_parser

                local = build_engine(build_parser().parse_args(engine_argv), "verifier").engine
                remote = GrpcVerifier(service.address)
            else:
                from specsplit.feature_drafter import load_feature_drafter

                local = load_feature_drafter(HEAD, 1024)
                remote = GrpcDrafter(service.address)
            times: dict[str, list[float]] = {"in-process": [], "over gRPC": [], "  of which the service's compute_s": []}
            gen = torch.Generator().manual_seed(0)
            for rep in range(args.reps):
                for side in (("in-process", "over gRPC") if rep % 2 == 0 else ("over gRPC", "in-process")):
                    engine = local if side == "in-process" else remote
                    os.sched_setaffinity(0, {service_cpu} if side == "in-process" else {caller_cpu})
                    seq = f"{side[:2]}{rep}"
                    tokens = list(range(100 + rep, 100 + rep + PROMPT))
                    engine.add([SeqAdd(seq, tuple(tokens))])
                    if args.role == "verifier":
                        engine.verify([VerifyRequest(seq)])  # the prefill

                        def call():
                            return engine.verify([VerifyRequest(seq)])
                    else:
                        width = local.feature_size
                        feats = torch.randn(PROMPT, width, generator=gen)
                        drafted = engine.propose([ProposeRequest(seq, (), K, features=feats, features_start=0)])[0]

                        def call():
                            nonlocal drafted
                            start = len(tokens) - 1
                            new = ((drafted.token_ids or (5,))[0], 7 + len(tokens) % 900)  # a draft accepted, a bonus
                            tokens.extend(new)
                            drafted = engine.propose([ProposeRequest(seq, new, K, features=torch.randn(2, width, generator=gen),
                                                                     features_start=start)])[0]
                    if side == "over gRPC":
                        remote.take_network_seconds()
                    for _ in range(STEPS):
                        t0 = time.perf_counter()
                        call()
                        dt = time.perf_counter() - t0
                        times[side].append(dt)
                        if side == "over gRPC":
                            times["  of which the service's compute_s"].append(dt - remote.take_network_seconds())
                    engine.release([seq])
        finally:
            service.stop()
    what = "decode row" if args.role == "verifier" else f"propose (2 feature rows, K = {K})"
    print(f"{args.role} ({model}), one {what} per call, {args.reps} x {STEPS} calls per side, "
          f"service on CPU {service_cpu}, caller on CPU {caller_cpu}:")
    for name, xs in times.items():
        print(f"  {name:36s} median {statistics.median(xs) * 1e3:7.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
