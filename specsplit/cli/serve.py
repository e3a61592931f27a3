"""`specsplit serve`: the colocated server (gateway + engines in one process, one memory budget)."""
from __future__ import annotations

from specsplit.cli.common import (add_engine_flags, add_http_flags, add_request_size_flag, add_server_flags, add_spec_flags, add_gateway_limit_flags,
                                  add_deterministic_flag, add_grammar_flag, add_tensor_parallel_flag, check_grammar_timeout, validate_engine, validate_http, validate_security)


def add_arguments(p, name: str) -> None:
    p.add_argument("--target", required=True, help="alias, Hugging Face directory or .gguf file")
    p.add_argument("--draft", default=None, help="draft model, 'ngram', MODEL+ngram or 'none' (target-only); omitted: "
                   "the target's best shipped draft (smollm2-135m: smollm2-135m-eagle3+ngram)")
    p.add_argument("--draft-device", default=None, help="device of the draft (default: --device)")
    p.add_argument("--max-queue", type=int, default=64, help="waiting requests before RESOURCE_EXHAUSTED")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds to let live streams finish before stopping (default 30)")
    add_engine_flags(p)
    add_spec_flags(p)
    add_tensor_parallel_flag(p)  # the target's; the draft stays at 1
    add_deterministic_flag(p)
    add_request_size_flag(p)
    add_grammar_flag(p)
    add_gateway_limit_flags(p)
    add_server_flags(p, 50051)
    add_http_flags(p)


def validate(args) -> None:
    from specsplit.defaults import resolve_draft

    args.draft = resolve_draft(args.target, args.draft, getattr(args, "tensor_parallel_size", 1))
    validate_security(args)
    check_grammar_timeout(args)
    validate_http(args)
    validate_engine(args)
    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")


def run(args) -> int:
    from specsplit.gateway.app import run_colocated
    from specsplit.rpc.serving import exit_now

    exit_now(run_colocated(args))
