"""Verify cost v(k) of the target's forward per CPU kernel policy, interleaved run by run.

    python tools/verify_cost.py [--model smollm2-135m] [--dtype fp32] [--policies dense,auto] [--reps 5]
                                [--weights native,fp32]

One model per policy (SPECSPLIT_LINEAR_KERNEL, see specsplit/models/cpu_linear.py) over the same
cached context; per round every policy times a 1-token forward and a (k+1)-token forward for each
k, in turn, so the VM's drift hits every policy alike; medians over the rounds. Prints the
kernel table each policy chose, the 1-token step in ms and v(k) = t(k+1 tokens) / t(1 token).
With --weights (comma-separated native, fp32, bf16: how a GGUF model's weights are held) every
policy runs once per weights mode.
To see an AVX2-only CPU's kernels on an AVX-512 machine, run it with
ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--policies", default="dense,auto")
    p.add_argument("--ks", default="1,2,3,4")
    p.add_argument("--context", type=int, default=300, help="cached tokens before the timed forward")
    p.add_argument("--reps", type=int, default=5, help="rounds; each policy's median is printed")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--weights", default="fp32", help="comma-separated: native, fp32, bf16 (default fp32, the dense path); "
                   "native-rows, native-4k, native-layers switch one load-time choice off (specsplit/bench/weights_arms.py)")
    args = p.parse_args()

    import torch

    from specsplit.config import parse_dtype
    from specsplit.bench import weights_arms
    from specsplit.models.loader import load_model
    from specsplit.models.runner import ForwardItem, ModelRunner

    torch.set_num_threads(args.threads)
    ks = [int(k) for k in args.ks.split(",")]
    runners = {}
    modes = args.weights.split(",")
    for policy in args.policies.split(","):
        for weights in modes:
            os.environ["SPECSPLIT_LINEAR_KERNEL"] = policy
            with weights_arms.loading(weights) as held:
                model = load_model(args.model, dtype=parse_dtype(args.dtype), show_progress=False, weights=held).model
            runner = ModelRunner(model, num_blocks=64, block_size=16, max_model_len=1024)
            prompt = [(7 * j + 3) % model.cfg.vocab_size for j in range(args.context + max(ks) + 1)]
            runner.forward([ForwardItem("s", 0, prompt[: args.context])])
            runners[policy if len(modes) == 1 else f"{policy} {weights}"] = (runner, prompt, model.kernel_tables)

    def timed(runner, prompt, q: int) -> float:
        t0 = time.perf_counter()
        runner.forward([ForwardItem("s", args.context, prompt[args.context: args.context + q], q)])
        dt = time.perf_counter() - t0
        runner.truncate("s", args.context)
        return dt

    times = {pol: {q: [] for q in [1] + [k + 1 for k in ks]} for pol in runners}
    for pol, (runner, prompt, _) in runners.items():  # warm every shape once
        for q in times[pol]:
            timed(runner, prompt, q)
    for _ in range(args.reps):
        for pol, (runner, prompt, _) in runners.items():
            for q in times[pol]:
                times[pol][q].append(timed(runner, prompt, q))
    flags = open("/proc/cpuinfo").read()
    isa = "AMX" if "amx_tile" in flags else ("AVX-512" if "avx512f" in flags else "AVX2")
    print(f"{args.model} {args.dtype}, {args.threads} thread(s), context {args.context}, CPU {isa}, "
          f"ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', '-')}, medians of {args.reps} interleaved rounds")
    for pol, (_, _, tables) in runners.items():
        t1 = statistics.median(times[pol][1])
        vs = ", ".join(f"v({k})={statistics.median(times[pol][k + 1]) / t1:.2f}" for k in ks)
        print(f"  {pol:12s} step {1e3 * t1:6.1f} ms  {vs}")
        if tables:
            print("          " + "; ".join(f"{n}: {t.describe()}" for n, t in tables.items()))


if __name__ == "__main__":
    main()
