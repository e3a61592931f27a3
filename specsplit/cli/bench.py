"""`specsplit bench`: benchmark arms side by side on the same prompts."""
from __future__ import annotations


def add_arguments(p, name: str) -> None:
    p.add_argument("suite", nargs="?", default="target", choices=["target", "spec", "all"])
    p.add_argument("--quick", action="store_true")


def run(args) -> int:
    raise RuntimeError("`specsplit bench` is not implemented yet")
