"""`specsplit profile`: the memory plan without serving.

Loads the model(s), measures weights and the activation peak of a profile run exactly as the
services do at start-up, sizes the KV cache(s) from the budget and prints the plan; no cache is
allocated. --colocated: both models in one process with one joint budget (as `specsplit serve`);
otherwise each service (verifier, drafter) on its own budget and device (as `specsplit verifier`
and `specsplit drafter`). A budget too small for the weights or for one --max-model-len sequence
exits 1 with the numbers.
"""
from __future__ import annotations

import sys

from specsplit.cli.common import add_engine_flags, add_spec_flags, engine_config, spec_config, validate_engine


def add_arguments(p, name: str) -> None:
    p.add_argument("--target", required=True)
    p.add_argument("--draft", default=None)
    p.add_argument("--draft-device", default=None)
    p.add_argument("--colocated", action="store_true", help="one joint budget for both models")
    p.add_argument("--json", action="store_true")
    add_engine_flags(p)
    add_spec_flags(p)


def validate(args) -> None:
    from specsplit.defaults import resolve_draft

    args.draft = resolve_draft(args.target, args.draft, getattr(args, "tensor_parallel_size", 1))
    validate_engine(args)


def run(args) -> int:
    from specsplit.factory import plan_memory, set_threads

    set_threads(args.threads)
    target = engine_config(args, args.target)
    draft = engine_config(args, args.draft, args.draft_device) if args.draft else None
    spec = spec_config(args, args.draft)
    plan = plan_memory(target, draft, spec, colocated=args.colocated, show_progress=not args.json)
    if args.json:
        print(plan.to_json())
    else:
        mode = "joint budget (colocated)" if plan.joint else "one budget per service"
        print(f"memory plan, {mode}:", file=sys.stdout)
        for line in plan.log_lines():
            print("  " + line)
    return 0
