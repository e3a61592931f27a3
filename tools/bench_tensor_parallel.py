"""Tensor parallel and --deterministic on the CPU: SmolLM2-135M greedy, tokens/s, at

    tp1-1t        target-only, one rank, 1 torch thread
    tp1-2t        target-only, one rank, 2 torch threads
    tp2           target-only, two ranks (this process + one worker, gloo), 1 thread each
    tp1-1t-det    target-only, one rank, 1 thread, --deterministic
    spec-1t       speculative (the shipped draft + prompt lookup, K=3), one rank, 1 thread
    spec-1t-det   the same with --deterministic (its output equals tp1-1t-det's, bit for bit)

Batch 1, held-out ShareGPT prompts with the chat template, EOS ignored; the arms run interleaved
run by run (each arm once per prompt and repeat, in turn) so that drift of the machine hits all
of them alike; tokens/s is new tokens over the wall time of the request (prefill included), the
median over prompts x repeats, and TPOT the median time per token after the first.

    PYTHONPATH=. .venv/bin/python tools/bench_tensor_parallel.py --dtype fp32 --num-prompts 4 --new-tokens 64 --repeats 3
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace

import torch


def _cpu() -> str:
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--arms", default="tp1-1t,tp1-2t,tp2,tp1-1t-det,spec-1t,spec-1t-det")
    args = ap.parse_args()

    from specsplit.bench.suite import heldout_prompts
    from specsplit.config import EngineConfig, SpecConfig, parse_dtype
    from specsplit.factory import build_draft_engine, build_target_engine
    from specsplit.hybrid_drafter import HybridDrafter
    from specsplit.models.registry import DRAFT_ALIAS
    from specsplit.request import GenerationRequest
    from specsplit.scheduler import Scheduler
    from specsplit.models.loader import hf_dir_for, load_tokenizer
    from specsplit.parallel.group import TPGroup
    from specsplit.spec import SpecDecoder

    max_len = 512
    cfg = EngineConfig(model=args.model, dtype=parse_dtype(args.dtype), max_model_len=max_len, max_num_seqs=1,
                       max_prefill_tokens=256, memory_budget_bytes=8 << 30)
    spec0 = SpecConfig(num_speculative_tokens=0)
    tok = load_tokenizer(hf_dir_for(args.model, show_progress=False))
    prompts = heldout_prompts(tok, args.num_prompts, 256)

    torch.set_num_threads(1)
    wanted = args.arms.split(",")
    det_cfg = replace(cfg, deterministic=True)
    spec = SpecConfig(num_speculative_tokens=3)
    group = None
    engines = {}
    if "tp2" in wanted:
        group, engines["tp2"], _ = TPGroup.launch(cfg, spec, 2, threads=1)
    engines["tp1"] = build_target_engine(cfg, spec).engine
    if any(a.endswith("-det") for a in wanted):
        engines["det"] = build_target_engine(det_cfg, spec).engine
    drafter = None
    if any(a.startswith("spec") for a in wanted):
        d = build_draft_engine(EngineConfig(model=DRAFT_ALIAS, dtype=cfg.dtype, max_model_len=max_len, max_num_seqs=1,
                                            max_prefill_tokens=256, memory_budget_bytes=2 << 30), spec).engine
        drafter = HybridDrafter(d, spec.ngram_min, spec.ngram_max, spec.draft_model_tokens)
    layout = {"tp1-1t": ("tp1", 1, False), "tp1-2t": ("tp1", 2, False), "tp2": ("tp2", 1, False),
              "tp1-1t-det": ("det", 1, False), "spec-1t": ("tp1", 1, True), "spec-1t-det": ("det", 1, True)}
    arms = {a: (engines[layout[a][0]], layout[a][1]) for a in wanted}
    decoders = {a: SpecDecoder(arms[a][0], drafter if layout[a][2] else None,
                               spec if layout[a][2] else spec0, max_len) for a in wanted}
    outputs: dict = {}

    def run(name, prompt, i):
        torch.set_num_threads(arms[name][1])
        gen = Scheduler(decoders[name], (), 1)
        req = GenerationRequest(f"{name}-{i}", tuple(prompt), args.new_tokens, ignore_eos=True)
        times = []
        t0 = time.perf_counter()
        state = gen.submit(req)
        n_prev = 0
        while gen.waiting or gen.running:
            gen.step()
            now = time.perf_counter()
            n = len(state.output)
            times.extend([now] * (n - n_prev))
            n_prev = n
        wall = time.perf_counter() - t0
        tpot = (times[-1] - times[0]) / max(1, len(times) - 1) if len(times) > 1 else float("nan")
        outputs.setdefault(name, {})[tuple(prompt)] = list(state.output)
        return args.new_tokens / wall, tpot

    for name in arms:  # warm-up, discarded
        run(name, prompts[0], -1)
    results = {name: {"tok_s": [], "tpot_ms": []} for name in arms}
    for rep in range(args.repeats):
        for i, p in enumerate(prompts):
            for name in arms:
                tps, tpot = run(name, p, rep * 1000 + i)
                results[name]["tok_s"].append(tps)
                results[name]["tpot_ms"].append(tpot * 1e3)
    if group is not None:
        group.close()
    same = {}
    if "spec-1t-det" in outputs and "tp1-1t-det" in outputs:
        same["spec-1t-det == tp1-1t-det"] = outputs["spec-1t-det"] == outputs["tp1-1t-det"]
    if "spec-1t" in outputs and "tp1-1t" in outputs:
        same["spec-1t == tp1-1t"] = outputs["spec-1t"] == outputs["tp1-1t"]
    if "tp2" in outputs and "tp1-1t" in outputs:
        same["tp2 == tp1-1t"] = outputs["tp2"] == outputs["tp1-1t"]
    summary = {name: {"tok_s_median": statistics.median(r["tok_s"]), "tpot_ms_median": statistics.median(r["tpot_ms"]),
                      "tok_s_all": [round(x, 2) for x in r["tok_s"]]} for name, r in results.items()}
    print(f"{args.model} {args.dtype}, batch 1, {len(prompts)} prompts x {args.new_tokens} tokens x {args.repeats} repeats")
    for name, s in summary.items():
        print(f"  {name:12s} {s['tok_s_median']:6.1f} tok/s   TPOT {s['tpot_ms_median']:6.1f} ms   "
              + (f"vs tp1-1t {s['tok_s_median'] / summary['tp1-1t']['tok_s_median']:.2f}x" if "tp1-1t" in summary else ""))
    print("  same greedy tokens:", same)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "cpu": _cpu(), "results": summary, "same_tokens": same}, f, indent=2)


if __name__ == "__main__":
    main()
