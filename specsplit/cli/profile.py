"""`specsplit profile`: the memory plan without serving."""
from __future__ import annotations

from specsplit.cli.common import add_engine_flags, add_spec_flags, validate_engine


def add_arguments(p, name: str) -> None:
    p.add_argument("--target", required=True)
    p.add_argument("--draft", default=None)
    p.add_argument("--draft-device", default=None)
    p.add_argument("--colocated", action="store_true", help="one joint budget for both models")
    p.add_argument("--json", action="store_true")
    add_engine_flags(p)
    add_spec_flags(p)


def validate(args) -> None:
    validate_engine(args)


def run(args) -> int:
    raise RuntimeError("`specsplit profile` is not implemented yet (memory profiler issue)")
