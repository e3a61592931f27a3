"""--http-port / --http-host on `specsplit gateway` and `specsplit serve` (and nowhere else)."""
from __future__ import annotations

import pytest

from specsplit.cli import build_parser
from specsplit.cli.common import validate_http

GATEWAY = ["gateway", "--verifier", "127.0.0.1:50062"]
SERVE = ["serve", "--target", "smollm2-135m"]


@pytest.mark.parametrize("argv", [GATEWAY, SERVE], ids=["gateway", "serve"])
def test_http_is_off_unless_asked(argv):
    args = build_parser().parse_args(argv)
    assert args.http_port is None and args.http_host is None
    args = build_parser().parse_args([*argv, "--http-port", "8000", "--http-host", "0.0.0.0"])
    assert (args.http_port, args.http_host) == (8000, "0.0.0.0")
    validate_http(args)


@pytest.mark.parametrize("argv", [GATEWAY, SERVE], ids=["gateway", "serve"])
def test_the_grpc_port_is_refused(argv):
    args = build_parser().parse_args([*argv, "--port", "9000", "--http-port", "9000"])
    with pytest.raises(ValueError, match="--http-port 9000 is the gRPC --port"):
        validate_http(args)
    validate_http(build_parser().parse_args([*argv, "--port", "9000", "--http-port", "9000", "--http-host", "10.0.0.1"]))


@pytest.mark.parametrize("service", ["drafter", "verifier"])
def test_engines_have_no_http_api(service):
    with pytest.raises(SystemExit):
        build_parser().parse_args([service, "--model", "ngram", "--http-port", "8000"])


def test_up_passes_the_http_flags_to_its_gateway():
    from specsplit.cli.up import commands

    argv = ["up", "--target", "smollm2-135m", "--draft", "ngram"]
    cmds = commands(build_parser().parse_args(argv), 1, 2)
    assert "--http-port" not in cmds["gateway"]
    cmds = commands(build_parser().parse_args([*argv, "--http-port", "8000"]), 1, 2)
    gw = cmds["gateway"]
    assert gw[gw.index("--http-port") + 1] == "8000" and "--http-host" not in gw
    assert all("--http-port" not in cmds[n] for n in ("drafter", "verifier"))


@pytest.mark.parametrize("argv", [GATEWAY, SERVE], ids=["gateway", "serve"])
def test_tool_call_stream_is_decided_unless_asked(argv):
    assert build_parser().parse_args(argv).tool_call_stream == "decided"
    assert build_parser().parse_args([*argv, "--tool-call-stream", "eager"]).tool_call_stream == "eager"
    with pytest.raises(SystemExit):
        build_parser().parse_args([*argv, "--tool-call-stream", "sometimes"])


def test_up_passes_the_tool_call_stream_to_its_gateway():
    from specsplit.cli.up import commands

    argv = ["up", "--target", "smollm2-135m", "--draft", "ngram", "--http-port", "8000", "--tool-call-stream", "eager"]
    gw = commands(build_parser().parse_args(argv), 1, 2)["gateway"]
    assert gw[gw.index("--tool-call-stream") + 1] == "eager"
    assert build_parser().parse_args(gw[gw.index("--log-level"):]).tool_call_stream == "eager"  # the gateway parses it
