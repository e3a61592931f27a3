"""`specsplit up`'s command lines: the engines bind --engine-host (loopback by default) and take the
internal token, never the public one; the gateway binds --host with the public token. (The real
processes: tests/e2e/test_up_exposure.py.)"""
from __future__ import annotations

from specsplit.cli import build_parser
from specsplit.cli.up import INTERNAL_TOKEN_ENV, commands, internal_token

UP = ["up", "--target", "t", "--draft", "ngram", "--host", "0.0.0.0", "--auth-token-file", "/public"]


def _value(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def test_engines_bind_loopback_with_the_internal_token_only():
    cmds = commands(build_parser().parse_args(UP), 1, 2)
    for name in ("drafter", "verifier"):
        assert _value(cmds[name], "--host") == "127.0.0.1"
        assert _value(cmds[name], "--auth-token-env") == INTERNAL_TOKEN_ENV
        assert "/public" not in cmds[name]
    gw = cmds["gateway"]
    assert _value(gw, "--host") == "0.0.0.0" and _value(gw, "--auth-token-file") == "/public"
    assert _value(gw, "--internal-auth-token-env") == INTERNAL_TOKEN_ENV
    assert _value(gw, "--verifier") == "127.0.0.1:2" and _value(gw, "--drafter") == "127.0.0.1:1"


def test_engine_host_and_a_given_internal_token():
    args = build_parser().parse_args([*UP, "--engine-host", "10.0.0.5", "--internal-auth-token-file", "/internal"])
    cmds = commands(args, 1, 2)
    for name in ("drafter", "verifier"):
        assert _value(cmds[name], "--host") == "10.0.0.5" and _value(cmds[name], "--auth-token-file") == "/internal"
    assert _value(cmds["gateway"], "--internal-auth-token-file") == "/internal"
    assert _value(cmds["gateway"], "--verifier") == "10.0.0.5:2"
    assert internal_token(args) == (["--auth-token-file", "/internal"], {})


def test_the_internal_token_comes_from_the_environment_or_is_made_per_run():
    args = build_parser().parse_args(UP)
    assert internal_token(args, environ={INTERNAL_TOKEN_ENV: "mine"})[1] == {INTERNAL_TOKEN_ENV: "mine"}
    first, second = internal_token(args, environ={})[1], internal_token(args, environ={})[1]
    assert len(first[INTERNAL_TOKEN_ENV]) == 64 and first != second


def test_a_child_on_port_0_is_told_where_to_write_the_port_it_binds():
    files = {"verifier": "/run/v.port", "drafter": "/run/d.port", "gateway": "/run/g.port"}
    cmds = commands(build_parser().parse_args([*UP, "--port", "0"]), 0, 2, files)
    assert _value(cmds["drafter"], "--port") == "0" and _value(cmds["drafter"], "--port-file") == "/run/d.port"
    assert _value(cmds["gateway"], "--port") == "0" and _value(cmds["gateway"], "--port-file") == "/run/g.port"
    # a port given is bound as given: no file to wait for
    assert _value(cmds["verifier"], "--port") == "2" and "--port-file" not in cmds["verifier"]
    assert "--port-file" not in commands(build_parser().parse_args(UP), 0, 0, files)["gateway"]  # --port 50051
