"""Target-only decode tok/s of a GGUF model per --weights mode, alternating with llama.cpp's
llama-bench on the same file, one thread (docs/kernels.md, "GGUF weights at their own width").

    python tools/gguf_decode_bench.py [--model smollm2-135m] [--weights native,fp32] [--rounds 5]
                                      [--llama-bench PATH/TO/llama-bench] [--tokens 64] [--depth N]

--weights takes native, fp32, bf16, and native with suffixes that switch one load-time choice off
(specsplit/bench/weights_arms.py): native-rows (no AMX tiles layout), native-4k (no huge pages),
native-layers (one Python call per layer, not the compiled stack).

Each round runs `llama-bench -m FILE -t 1 -p 0 -n TOKENS -r 1` (its tg TOKENS), then a greedy
decode of TOKENS one-token steps (after an 8-token prompt; each step the server's greedy step,
`forward(greedy=True)`: on a Q8_0 head the int8 bound and its candidate rows, else the logits'
argmax; until the twentieth session it took the logits' argmax) with each weights mode, in turn, so the
shared machine's drift hits every arm alike; prints each arm's median and the ratios to llama.cpp.

--spec-prompts N adds two arms through the server's SpecDecoder (the first weights mode): the
target alone and the target with its default draft and flags (`specsplit serve --target MODEL`),
each generating TOKENS greedy tokens for N held-out ShareGPT prompts (chat template) per round;
their rate is decode tokens per second after the first token (prefill left out, as tg leaves it
out), over the round's prompts. Their contexts are the prompts' (tens to hundreds of tokens), where
llama-bench's tg starts from an empty one.

--depth N decodes after N tokens of context on both sides (llama-bench `-d N`; ours: N synthetic
tokens computed in 512-token pieces before the 8-token prompt): a long conversation's step, where
the attention over the cached context weighs as much as the weights.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--weights", default="native,fp32")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--llama-bench", default=None, help="a built llama-bench binary (omit: our arms only)")
    p.add_argument("--depth", type=int, default=0, help="tokens of context before the decode (llama-bench -d)")
    p.add_argument("--spec-prompts", type=int, default=0,
                   help="also target-only and default-flags speculative arms through the SpecDecoder over "
                        "this many held-out prompts per round (0: none)")
    args = p.parse_args()

    import torch

    from specsplit.models.registry import resolve_model_path
    from specsplit.models.runner import ForwardItem, ModelRunner

    torch.set_num_threads(1)
    gguf = resolve_model_path(args.model)
    modes = args.weights.split(",")
    models = {w: load_arm(args.model, w) for w in modes}

    def decode(model, n: int) -> tuple[float, list[int]]:
        length = args.depth + 8 + n + 16
        runner = ModelRunner(model, num_blocks=max(64, -(-length // 16) + 4), block_size=16, max_model_len=max(512, length))
        filler = [(7 * j + 3) % runner.vocab_size for j in range(args.depth)]
        for at in range(0, args.depth, 512):  # the context, in pieces (a 4k-token prompt's scores at once: GBs)
            runner.forward([ForwardItem("d", at, filler[at:at + 512], num_logits=1)], greedy=True)
        prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646]
        tok = int(runner.forward([ForwardItem("d", args.depth, prompt, num_logits=1)], greedy=True)[0][0])
        pos, out = args.depth + len(prompt), [tok]
        t0 = time.perf_counter()
        for _ in range(n):  # the greedy step the server takes: ids from forward(greedy=True)
            tok = int(runner.forward([ForwardItem("d", pos, [tok], num_logits=1)], greedy=True)[0][0])
            pos += 1
            out.append(tok)
        return n / (time.perf_counter() - t0), out

    def llama_cpp() -> float:
        depth = ["-d", str(args.depth)] if args.depth else []  # (a llama-bench older than -d runs without it)
        cmd = [args.llama_bench, "-m", str(gguf), "-t", "1", "-p", "0", "-n", str(args.tokens), *depth, "-r", "1", "-o", "json"]
        return float(json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)[0]["avg_ts"])

    for w in modes:
        decode(models[w], 8)  # warm up
    runs: dict[str, list[float]] = {w: [] for w in modes}
    if args.llama_bench:
        runs = {"llama.cpp": [], **runs}
    engines = served_arms(args.model, modes[0], args.spec_prompts, args.tokens) if args.spec_prompts else {}
    runs.update({name: [] for name in engines})
    tokens: dict[str, list[int]] = {}
    for _ in range(args.rounds):
        if args.llama_bench:
            runs["llama.cpp"].append(llama_cpp())
        for w in modes:
            tps, tokens[w] = decode(models[w], args.tokens)
            runs[w].append(tps)
        for name, once in engines.items():
            runs[name].append(once())
    flags = open("/proc/cpuinfo").read()
    isa = "AMX" if "amx_tile" in flags else ("AVX-512" if "avx512f" in flags else "AVX2")
    limits = [f"{k}={os.environ[k]}" for k in ("SPECSPLIT_QUANT_AVX512", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
              if k in os.environ]
    if limits:  # an AVX-512 machine standing in for an AVX2-only one
        isa += f" (ours limited by {' '.join(limits)})"
    depth = f" after {args.depth} tokens of context" if args.depth else ""
    print(f"{gguf.name}, decode {args.tokens} tokens{depth}, 1 thread, CPU {isa}, medians of {args.rounds} alternating rounds")
    ref = statistics.median(runs["llama.cpp"]) if args.llama_bench else None
    width = max(len(a) for a in runs)
    for arm, v in runs.items():
        med = statistics.median(v)
        ratio = f"  {med / ref:.2f}x llama.cpp" if ref and arm != "llama.cpp" else ""
        print(f"  {arm:{width}s} {med:6.1f} tok/s{ratio}   runs: {', '.join(f'{x:.1f}' for x in v)}")
    if len(modes) > 1:
        print("  same greedy tokens across weights modes:", len({tuple(t) for t in tokens.values()}) == 1)


def load_arm(model: str, arm: str):
    """One weights arm's model (specsplit/bench/weights_arms.py: native, native-rows, native-4k, ...)."""
    from specsplit.bench import weights_arms
    from specsplit.models.loader import load_model

    with weights_arms.loading(arm) as weights:
        return load_model(model, show_progress=False, weights=weights).model


def served_arms(model: str, arm_name: str, num_prompts: int, new_tokens: int) -> dict:
    """name -> one round of that arm (decode tok/s after the first token over the held-out
    prompts): the target alone and with its default draft and flags, through SpecDecoder, both
    loaded under the weights arm's switches (native-rows: the rows layout, ...)."""
    from specsplit.bench import weights_arms
    from specsplit.bench.arms import generate_timed
    from specsplit.bench.suite import heldout_prompts
    from specsplit.config import EngineConfig, SpecConfig
    from specsplit.defaults import resolve_draft, spec_config
    from specsplit.factory import build_colocated

    def cfg(name: str) -> EngineConfig:
        return EngineConfig(model=name, weights=weights, max_model_len=1024, max_num_seqs=1, prefix_caching=False)

    draft = resolve_draft(model, None)
    flags = argparse.Namespace(num_speculative_tokens=None, device="cpu")  # `specsplit serve`'s defaults
    with weights_arms.loading(arm_name) as weights:
        base = build_colocated(cfg(model), None, SpecConfig(num_speculative_tokens=0), show_progress=False)
        spec = build_colocated(cfg(model), cfg(draft), spec_config(flags, draft), show_progress=False)
    prompts = heldout_prompts(base.tokenizer, num_prompts, 512, chat=True)

    def arm(colo):
        def once() -> float:
            tokens = seconds = 0.0
            for i, p in enumerate(prompts):
                t = generate_timed(colo, [p], new_tokens, None, f"r{i}")[0]
                tokens += t.tokens - 1
                seconds += t.total_s - t.ttft_s
            return tokens / seconds
        once()  # warm up (calibration, first features)
        return once

    return {"served target-only": arm(base), f"served {draft}": arm(spec)}


if __name__ == "__main__":
    main()
