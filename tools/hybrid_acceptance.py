"""Acceptance of drafts, arm by arm, on the same held-out prompts (greedy, colocated, fixed K).

Each arm is a draft name, optionally with `@N`: prompt lookup before the model needs a match of N
tokens or more (SpecConfig.ngram_min; N is not forced up for an EAGLE-3 head here, so the arms
show what each minimum does). Prints, per arm, accepted tokens per speculative step and per
drafted token, and for a hybrid how many steps each source drafted and what they got accepted
(HybridDrafter.judged). Acceptance is a count, not a time: a loaded machine does not change it.
Every arm's tokens are checked equal (greedy).

    PYTHONPATH=. python tools/hybrid_acceptance.py --arms smollm2-135m-eagle3,smollm2-135m-eagle3+ngram@1,\\
        smollm2-135m-eagle3+ngram@3 --num-prompts 24 --skip 16 --new-tokens 64

--passes 2 runs the prompts twice: on the second pass a suffix drafter (`MODEL+suffix`) has the
first pass's answers in its shared cache, so that pass is the repetition workload.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specsplit.bench.arms import generate_timed  # noqa: E402
from specsplit.bench.suite import heldout_prompts  # noqa: E402
from specsplit.config import EngineConfig, SpecConfig, parse_dtype  # noqa: E402
from specsplit.factory import build_colocated  # noqa: E402
from specsplit.hybrid_drafter import HybridDrafter  # noqa: E402


def _source_counts(drafter) -> tuple[int, int, int, int] | None:
    """A hybrid's running counts (lookup steps, lookup drafts accepted, model steps, model drafts
    accepted), None for another drafter: a pass reports the difference, leaving the drafter's
    counters (its model_share, its metrics) as they run."""
    if not isinstance(drafter, HybridDrafter):
        return None
    return (drafter.lookup_steps, drafter.judged["lookup"][1], drafter.model_steps, drafter.judged["model"][1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--arms", required=True, help="comma-separated DRAFT[@NGRAM_MIN]")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--skip", type=int, default=0, help="start after this many held-out prompts")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--passes", type=int, default=1,
                    help="run the prompts this many times (a suffix drafter's later passes repeat answers it has "
                         "seen: the repetition workload); each pass's totals are printed")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    def cfg(model: str) -> EngineConfig:
        return EngineConfig(model=model, dtype=parse_dtype("fp32"), device="cpu", max_model_len=2048, max_num_seqs=1,
                            max_prefill_tokens=512, prefix_caching=False)

    arms = {}
    for arm in args.arms.split(","):
        draft, _, nmin = arm.partition("@")
        colo = build_colocated(cfg(args.target), cfg(draft), SpecConfig(num_speculative_tokens=args.k, k_policy="fixed",
                                                                      ngram_min=int(nmin or 1)), show_progress=False)
        if nmin and isinstance(colo.drafter, HybridDrafter):
            colo.drafter.ngram_min = int(nmin)  # this arm's minimum, as given (the server raises it for a head)
            colo.drafter.ngram_max = max(colo.drafter.ngram_max, int(nmin))
        arms[arm] = colo
    first = next(iter(arms.values()))
    prompts = heldout_prompts(first.tokenizer, args.num_prompts + args.skip, 1024, chat=True)[args.skip:]
    for p in range(args.passes):
        if args.passes > 1:
            print(f"pass {p + 1}/{args.passes}", flush=True)
        before = {arm: _source_counts(colo.drafter) for arm, colo in arms.items()}
        totals = {arm: [0, 0, 0] for arm in arms}  # accepted, speculative steps, proposed
        for i, prompt in enumerate(prompts):
            outputs = set()
            for arm, colo in arms.items():
                t = generate_timed(colo, [prompt], args.new_tokens, args.k, f"p{p}-{i}")[0]
                totals[arm][0] += t.accepted
                totals[arm][1] += t.steps
                totals[arm][2] += t.proposed
                outputs.add(tuple(t.output))
            if len(outputs) != 1:
                print(f"prompt {i}: the arms' greedy tokens differ", file=sys.stderr)
                return 1
            print(f"prompt {i + 1}/{len(prompts)}: " + ", ".join(f"{a} {v[0]}/{v[1]}" for a, v in totals.items()), flush=True)
        for arm, (acc, steps, proposed) in totals.items():
            line = f"{arm}: {acc / max(steps, 1):.3f} accepted per step, {acc / max(proposed, 1):.3f} per draft ({acc}/{steps} steps)"
            if before[arm] is not None:  # this pass's share of the hybrid's running counts
                lookup_steps, lookup_acc, model_steps, model_acc = (
                    now - then for now, then in zip(_source_counts(arms[arm].drafter), before[arm]))
                line += (f"; lookup drafted {lookup_steps} steps, {lookup_acc / max(lookup_steps, 1):.2f} accepted per step; "
                         f"model {model_steps} steps, {model_acc / max(model_steps, 1):.2f} per step")
            print(line)
    for colo in arms.values():
        colo.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
