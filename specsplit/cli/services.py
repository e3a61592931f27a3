"""`specsplit drafter | verifier | gateway`: one gRPC service per process."""
from __future__ import annotations

from specsplit.cli.common import (add_engine_flags, add_http_flags, add_keepalive_flags, add_request_size_flag, add_server_flags, add_spec_flags, add_gateway_limit_flags,
                                  add_deterministic_flag, add_grammar_flag, add_tensor_parallel_flag, check_address, check_grammar_timeout, positive_int, validate_engine, validate_http, validate_security)

DEFAULT_PORTS = {"drafter": 50061, "verifier": 50062, "gateway": 50051}


def add_arguments(p, name: str) -> None:
    if name in ("drafter", "verifier"):
        p.add_argument("--model", required=True, help="alias, Hugging Face directory, .gguf file" + (" or 'ngram'" if name == "drafter" else ""))
        add_engine_flags(p)
        add_spec_flags(p)
        if name == "verifier":
            add_tensor_parallel_flag(p)
            add_deterministic_flag(p)
            add_grammar_flag(p)
    else:
        p.add_argument("--drafter", default=None, metavar="HOST:PORT", help="drafter service (omit for target-only)")
        p.add_argument("--verifier", required=True, metavar="HOST:PORT", help="verifier service")
        p.add_argument("--max-num-seqs", type=positive_int, default=32, help="most sequences in one batch")
        p.add_argument("--max-queue", type=int, default=64, help="waiting requests before RESOURCE_EXHAUSTED")
        p.add_argument("--tokenizer", default=None,
                       help="tokenizer directory (default: the one the verifier reports; set it when the verifier runs on another host)")
        p.add_argument("--drafter-timeout", type=float, default=5.0,
                       help="seconds per drafter call before decoding target-only (default 5)")
        p.add_argument("--verifier-timeout", type=float, default=120.0, help="seconds per verifier call (default 120)")
        p.add_argument("--connect-timeout", type=float, default=300.0,
                       help="seconds to wait at start-up for the verifier to answer (default 300)")
        p.add_argument("--drafter-connect-timeout", type=float, default=10.0,
                       help="seconds to wait at start-up for the drafter to answer; past it the gateway serves "
                            "target-only and the drafter joins when it answers (default 10)")
        add_spec_flags(p)
        add_request_size_flag(p)
        add_grammar_flag(p)
        add_gateway_limit_flags(p)
        add_keepalive_flags(p)
        from specsplit.rpc.security import add_client_security_flags

        add_client_security_flags(p, "internal_", "the drafter and the verifier")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds to let live streams finish before stopping (default 30)")
    add_server_flags(p, DEFAULT_PORTS[name])
    if name == "gateway":
        add_http_flags(p)


def validate(args) -> None:
    validate_security(args)
    check_grammar_timeout(args)
    if args.command in ("drafter", "verifier"):
        validate_engine(args)
    else:
        validate_http(args)
        if args.max_queue < 0:
            raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
        for flag in ("drafter_timeout", "verifier_timeout", "connect_timeout"):
            if getattr(args, flag) <= 0:
                raise ValueError(f"--{flag.replace('_', '-')} must be positive")
        check_address("--drafter", args.drafter)
        check_address("--verifier", args.verifier)


def run(args) -> int:
    if args.command == "drafter":
        from specsplit.drafter_svc.service import main
    elif args.command == "verifier":
        from specsplit.verifier_svc.service import main
    else:
        from specsplit.gateway.app import run_split as main
    from specsplit.rpc.serving import exit_now

    exit_now(main(args))
