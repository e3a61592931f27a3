"""`specsplit up --draft none`: a split target-only stack, the verifier and the gateway (no drafter
process, K 0); a target with no default draft and no --draft is refused with what to give. (The
real processes: tests/e2e/test_up_split.py::test_up_draft_none_runs_verifier_and_gateway.)"""
from __future__ import annotations

import pytest

from specsplit.cli import build_parser
from specsplit.cli.up import commands, services, validate


def _args(*argv):
    args = build_parser().parse_args(["up", *argv])
    validate(args)
    return args


def _value(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def test_draft_none_starts_the_verifier_and_the_gateway_only():
    args = _args("--target", "smollm2-135m", "--draft", "none")
    assert args.draft is None and services(args) == ("verifier", "gateway")
    cmds = commands(args, 0, 7)
    assert set(cmds) == {"verifier", "gateway"}
    gw = cmds["gateway"]
    assert "--drafter" not in gw and _value(gw, "--verifier") == "127.0.0.1:7"
    assert _value(gw, "--num-speculative-tokens") == _value(cmds["verifier"], "--num-speculative-tokens") == "0"


def test_the_default_draft_starts_all_three():
    args = _args("--target", "smollm2-135m")
    assert args.draft == "smollm2-135m-eagle3+ngram" and services(args) == ("verifier", "drafter", "gateway")
    cmds = commands(args, 5, 7)
    assert _value(cmds["gateway"], "--drafter") == "127.0.0.1:5" and _value(cmds["drafter"], "--model") == args.draft


def test_a_target_without_a_default_draft_says_what_to_give(tiny_llama):
    with pytest.raises(ValueError, match="no default draft: give --draft MODEL .* or --draft none"):
        _args("--target", str(tiny_llama))
    assert services(_args("--target", str(tiny_llama), "--draft", "NONE")) == ("verifier", "gateway")
