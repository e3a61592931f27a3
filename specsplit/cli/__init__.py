"""The `specsplit` command line: one module per subcommand, each with add_arguments(p) and run(args).

Every subcommand takes `--check`: parse and validate the arguments without loading a model, then
exit 0 (or non-zero with the reason). compose.yaml's command lines are tested that way.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("specsplit.cli.generate", "generate once, in-process or through a gateway (--server)"),
    "serve": ("specsplit.cli.serve", "colocated server: gateway + target (+ draft) in one process"),
    "drafter": ("specsplit.cli.services", "serve a draft model (or the n-gram proposer) over gRPC"),
    "verifier": ("specsplit.cli.services", "serve a target model over gRPC"),
    "gateway": ("specsplit.cli.services", "public Generate API in front of a drafter and a verifier"),
    "up": ("specsplit.cli.up", "start drafter, verifier and gateway locally; stop them all on Ctrl-C"),
    "token": ("specsplit.cli.token", "create the internal bearer token file once (compose runs it before the services)"),
    "health": ("specsplit.cli.health", "query a service's gRPC health (exit 0 when SERVING)"),
    "profile": ("specsplit.cli.profile", "print the memory plan (weights, activations, KV blocks) without serving"),
    "bench": ("specsplit.cli.bench", "benchmarks: target-only and speculative arms side by side"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specsplit", description="Lossless speculative decoding over gRPC.")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        mod = importlib.import_module(module)
        p = sub.add_parser(name, help=help_text, description=help_text)
        mod.add_arguments(p, name)
        p.add_argument("--check", action="store_true", help="validate the arguments and exit without loading models")
        p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    from specsplit.request import RequestError

    mod = importlib.import_module(args._module)
    validate = getattr(mod, "validate", None)
    try:
        if validate is not None:
            validate(args)
    except ValueError as e:
        print(f"specsplit {args.command}: {e}", file=sys.stderr)
        return 2
    if args.check:
        print(f"specsplit {args.command}: arguments OK")
        return 0
    try:
        return int(mod.run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError, RuntimeError, RequestError) as e:
        print(f"specsplit {args.command}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
