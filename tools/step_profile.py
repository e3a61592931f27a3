"""Where a served decode step's time goes, part by part (colocated, batch 1, one torch thread).

Generates greedy answers to held-out chat prompts through the colocated scheduler (the path the
public API takes) and times every call of the step's parts by wrapping them: the step, the verify
and its forward (the layer stack, the head), the acceptance, the drafter's propose (its feature
commit and its draft), the K policy. Only decode steps count: a step whose forward holds more than
8 tokens is a prefill and is left out. The parts nest (a step holds its verify, which holds its
forward, ...); what a part does not cover is Python and small torch ops around it.

    PYTHONPATH=. OMP_NUM_THREADS=1 python tools/step_profile.py [--draft DRAFT | --draft none]
        [--num-prompts 6] [--new-tokens 64] [--rounds 2] [--fixed-k K] [--tree-nodes N]

--fixed-k drafts K tokens every step (`--k-policy fixed`); by default the K policy chooses, as
the server's default flags do (so a step may draft nothing). --tree-nodes lets a step's drafts
add up to N branch nodes (docs/tree-verification.md; with the K policy, its rule sizes them).

The wrappers cost ~1 us a call; compare arms (old and new trees on PYTHONPATH) run by run.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specsplit.bench.arms import generate_timed  # noqa: E402
from specsplit.bench.suite import heldout_prompts  # noqa: E402
from specsplit.config import EngineConfig, SpecConfig  # noqa: E402
from specsplit.defaults import resolve_draft, spec_config  # noqa: E402
from specsplit.engine import TargetEngine  # noqa: E402
from specsplit.factory import build_colocated  # noqa: E402
from specsplit.feature_drafter import FeatureDrafter  # noqa: E402
from specsplit.models.llama import LlamaForCausalLM  # noqa: E402
from specsplit.models.runner import ModelRunner  # noqa: E402
from specsplit.scheduler import Scheduler  # noqa: E402
from specsplit.spec.decoder import SpecDecoder  # noqa: E402

PREFILL_TOKENS = 8  # a forward with more tokens than this makes its step a prefill one
# (label, class, method), in nesting order; the first is the step
PARTS = (
    ("step", Scheduler, "step"),
    ("  verify", TargetEngine, "verify"),
    ("    forward", LlamaForCausalLM, "forward"),
    ("      layer stack", LlamaForCausalLM, "_stack_step"),
    ("      head: greedy ids", LlamaForCausalLM, "_greedy_head"),
    ("      head: logits", LlamaForCausalLM, "_full_logits"),
    ("    accept (greedy)", TargetEngine, "_accept_greedy"),
    ("    accept (tree)", TargetEngine, "_verify_tree"),
    ("      move kv", ModelRunner, "move_kv"),
    ("  k policy", SpecDecoder, "_choose_k"),
    ("  propose", SpecDecoder, "_propose"),
    ("    feature commit", FeatureDrafter, "_commit_features"),
    ("    draft", FeatureDrafter, "_draft"),
    ("  accounting", SpecDecoder, "_account"),
)


class StepTimer:
    """Wraps PARTS' methods; per decode step, adds each part's time to the totals."""

    def __init__(self) -> None:
        self.seconds: Counter = Counter()
        self.calls: Counter = Counter()
        self.steps = 0
        self._step: Counter = Counter()
        self._step_calls: Counter = Counter()
        self._prefill = False
        self._saved = []

    def __enter__(self) -> "StepTimer":
        for label, owner, name in PARTS:
            original = owner.__dict__[name]
            self._saved.append((owner, name, original))
            setattr(owner, name, self._wrap(label, original, top=label == "step"))
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)

    def _wrap(self, label: str, fn, top: bool):
        timer = self

        def timed(*args, **kwargs):
            if top:
                timer._step.clear()
                timer._step_calls.clear()
                timer._prefill = False
            if fn.__name__ == "forward" and args[1].numel() > PREFILL_TOKENS:
                timer._prefill = True
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            timer._step[label] += time.perf_counter() - t0
            timer._step_calls[label] += 1
            if top and not timer._prefill and timer._step_calls["    forward"]:
                timer.seconds.update(timer._step)
                timer.calls.update(timer._step_calls)
                timer.steps += 1
            return out

        return timed

    def report(self) -> str:
        lines = [f"{self.steps} decode steps; per step:"]
        for label, _, _ in PARTS:
            if self.calls[label]:
                lines.append(f"{label:28s} {1e3 * self.seconds[label] / self.steps:7.3f} ms  "
                             f"({self.calls[label] / self.steps:.2f} calls)")
        return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--draft", default=None, help="a draft name, or none (default: the target's default draft)")
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--fixed-k", type=int, default=None, help="draft K every step (default: the K policy's choice)")
    ap.add_argument("--tree-nodes", type=int, default=0, help="branch nodes a step's draft tree may add (default 0: chains)")
    args = ap.parse_args()
    torch.set_num_threads(1)

    def cfg(name: str) -> EngineConfig:
        return EngineConfig(model=name, max_model_len=1024, max_num_seqs=1, prefix_caching=False)

    if args.draft == "none":
        colo = build_colocated(cfg(args.model), None, SpecConfig(num_speculative_tokens=0), show_progress=False)
        arm = "target-only"
    else:
        draft = resolve_draft(args.model, args.draft)
        spec = spec_config(argparse.Namespace(num_speculative_tokens=args.fixed_k, device="cpu",
                                              k_policy="fixed" if args.fixed_k else None, tree_nodes=args.tree_nodes),
                           draft)
        colo = build_colocated(cfg(args.model), cfg(draft), spec, show_progress=False)
        arm = draft
    prompts = heldout_prompts(colo.tokenizer, args.num_prompts, 512, chat=True)

    def generate(tag: str) -> float:  # decode tokens/s over the prompts
        tokens = seconds = 0.0
        for i, p in enumerate(prompts):
            t = generate_timed(colo, [p], args.new_tokens, None, f"{tag}{i}")[0]
            tokens += t.tokens - 1
            seconds += t.total_s - t.ttft_s
        return tokens / seconds

    generate("warm")
    with StepTimer() as timer:
        rates = [generate(f"r{r}-") for r in range(args.rounds)]
    print(f"{args.model}, {arm}, batch 1, {args.num_prompts} held-out prompts x {args.new_tokens} tokens, "
          f"{args.rounds} rounds: {', '.join(f'{r:.1f}' for r in rates)} tok/s")
    print(timer.report())


if __name__ == "__main__":
    main()
