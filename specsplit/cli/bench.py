"""`specsplit bench`: benchmark arms side by side on the same prompts (see specsplit.bench.suite)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from specsplit.cli.common import nonneg_int, positive_int


def add_arguments(p, name: str) -> None:
    p.add_argument("suite", nargs="?", default="all", choices=["target", "spec", "all", "async"],
                   help="async: pre-drafting vs lockstep, split vs colocated, 1-2 threads (specsplit/bench/overlap.py)")
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--draft", default=None,
                   help="model draft for the spec arms ('ngram' too); default: the target's default draft without its "
                        "prompt lookup (smollm2-135m: smollm2-135m-eagle3, so the policy arm runs the served "
                        "smollm2-135m-eagle3+ngram)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="dtype of the spec arms")
    p.add_argument("--weights", default="native",
                   help="how a GGUF target's weights are held (native, fp32, bf16; see `specsplit serve --help`); "
                        "comma-separated: the target suite runs one target-only arm per mode, interleaved, and the "
                        "spec suite uses the first (default %(default)s)")
    p.add_argument("--device", default="cpu", help="cpu, or cuda[:N] (tools/gpu_check.sh)")
    p.add_argument("--quick", action="store_true", help="a few minutes: 2 prompts, fewer arms")
    p.add_argument("--num-prompts", type=positive_int, default=None)
    p.add_argument("--new-tokens", type=positive_int, default=None)
    p.add_argument("--repeats", type=positive_int, default=None, help="runs per prompt; the median is kept")
    p.add_argument("--ks", default=None, help="comma-separated K values, default 1,2,3,4,6")
    p.add_argument("--split-ks", default=None,
                   help="comma-separated K values for the split arm (specsplit up, three local processes, talking "
                        "gRPC on loopback), default 2 for a model draft (4 for ngram); with --quick the first --ks "
                        "value")
    p.add_argument("--no-split", action="store_true", help="skip the split arm (no services started)")
    p.add_argument("--also-draft", action="append", default=[], metavar="DRAFT",
                   help="another draft whose fixed-K arms run interleaved with the others (repeatable), "
                        "e.g. the previous default to compare against")
    p.add_argument("--no-hybrid", action="store_true",
                   help="skip the DRAFT+ngram arms (the model draft with prompt lookup in front); without this flag "
                        "the split arm and the concurrency sweep use DRAFT+ngram")
    p.add_argument("--tree-nodes", type=nonneg_int, default=0,
                   help="spec suite: beside each draft's fixed-K chain arms, the same K with draft trees of up to N "
                        "branch nodes (docs/tree-verification.md), interleaved (0 = no tree arms, the default)")
    p.add_argument("--disable-by-batch-size", type=int, default=None,
                   help="threshold for the concurrency sweep's speculative arm (default: the servers' default)")
    p.add_argument("--concurrency", default=None, help="comma-separated, default 1,4,16,32")
    p.add_argument("--max-model-len", type=positive_int, default=1024)
    p.add_argument("--max-prompt-tokens", type=positive_int, default=384)
    p.add_argument("--prompt-token-ids", default=None, help="use these ids as every prompt (tiny models)")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers arms")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--out", default="bench_out", help="directory for bench.json and bench.png")


def validate(args) -> None:
    from specsplit.defaults import is_no_draft
    from specsplit.models.registry import check_model_argument

    # the models, before anything loads (a misspelt draft was found only after the target arms ran)
    named = [("--target", args.target, False), ("--draft", args.draft, True)]
    named += [("--also-draft", d, True) for d in args.also_draft]
    for flag, name, draft in named:
        if name is None:
            continue
        if draft and is_no_draft(name):
            raise ValueError(f"{flag} none: the spec arms need a draft (every suite runs target-only beside them; "
                             "`specsplit bench target` runs only that)")
        try:
            check_model_argument(name, draft, paths=not args.check)
        except ValueError as e:
            raise ValueError(f"{flag}: {e}") from None
    modes = args.weights.split(",")
    if not modes or any(m not in ("native", "fp32", "bf16") for m in modes):
        raise ValueError(f"--weights must be comma-separated native, fp32 or bf16, got {args.weights!r}")
    for name in ("ks", "split_ks", "concurrency"):
        v = getattr(args, name)
        if v is not None and not all(t.strip().isdigit() and int(t) > 0 for t in v.split(",")):
            raise ValueError(f"--{name.replace('_', '-')} must be comma-separated positive integers, got {v!r}")


def run(args) -> int:
    from specsplit.bench.suite import Bench, format_table, plot
    from specsplit.defaults import bench_draft
    from specsplit.factory import set_threads

    if args.draft is None:
        args.draft = bench_draft(args.target)

    set_threads(args.threads)
    if args.suite == "async":
        return _run_async(args)
    report = Bench(args).run()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(report, indent=2))
    png = plot(report, out / "bench.png")
    print(format_table(report))
    print(f"\nwrote {out / 'bench.json'}" + (f" and {png}" if png else ""), file=sys.stderr)
    return 0


def _run_async(args) -> int:
    from specsplit.bench import overlap
    from specsplit.bench.suite import heldout_prompts

    def prompts_of(colo):
        if args.prompt_token_ids:
            return [[int(t) for t in args.prompt_token_ids.split(",")]] * (args.num_prompts or 3)
        return heldout_prompts(colo.tokenizer, args.num_prompts or 3, args.max_prompt_tokens, chat=True)

    report = overlap.run(args, prompts_of)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_async.json").write_text(json.dumps(report, indent=2))
    print(overlap.format_report(report))
    print(f"\nwrote {out / 'bench_async.json'}", file=sys.stderr)
    return 0
