"""Safe by default in compose: internal traffic carries a bearer token that is generated once.

The `internal-token` service runs `specsplit token` into the `internal-token` volume; the drafter
and the verifier require it (--auth-token-file), the gateway sends it (--internal-auth-token-file).
Checked on the compose file, then for real: the token command as compose runs it, and a verifier
started with the compose file's security flags refusing a session without the token while a
gateway with the compose file's flags serves (real processes on loopback).
"""
from __future__ import annotations

import os
import stat
from pathlib import PurePosixPath

import grpc
import pytest

from specsplit.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from specsplit.rpc.security import ClientSecurity, channel
from tests.deploy import compose_support as cs
from tests.services.procs import TINY_ENGINE, ServiceProcess, free_port, generate, health, request

TOKEN = "internal-token"
ENGINES = ("drafter", "verifier")


def _services(env=None) -> dict:
    return cs.load(env)["services"]


def _args(service):
    return cs.parse_cli(cs.service_argv(service))


def _mounts(service) -> dict[str, tuple[str, bool]]:
    """named volume -> (container path, read-only)"""
    out = {}
    for v in service.get("volumes", []):
        source, target, *mode = str(v).split(":")
        out[source] = (target, mode == ["ro"])
    return out


@pytest.mark.parametrize("scenario", list(cs.SCENARIOS))
def test_engines_require_the_token_the_gateway_sends(scenario):
    services = _services(cs.SCENARIOS[scenario])
    token_args = _args(services[TOKEN])
    assert token_args.command == "token" and token_args.path == cs.INTERNAL_TOKEN
    for name in ENGINES:
        assert _args(services[name]).auth_token_file == cs.INTERNAL_TOKEN, f"{name} must require the token"
    assert _args(services["gateway"]).internal_auth_token_file == cs.INTERNAL_TOKEN
    directory = str(PurePosixPath(cs.INTERNAL_TOKEN).parent)
    assert _mounts(services[TOKEN])[TOKEN] == (directory, False)
    for name in (*ENGINES, "gateway"):
        assert _mounts(services[name]).get(TOKEN) == (directory, True), f"{name}: mount the token volume read-only"
        assert services[name]["depends_on"][TOKEN] == {"condition": "service_completed_successfully"}
    assert services[TOKEN]["restart"] == "no"
    assert TOKEN in cs.load()["volumes"]
    for name in ENGINES:  # never published: only the gateway (and the colocated server) are
        assert "ports" not in services[name]


def test_token_command_creates_once_and_keeps(tmp_path):
    argv = cs.service_argv(_services()[TOKEN])
    path = tmp_path / "run" / "internal-token"
    local = [a.replace(cs.INTERNAL_TOKEN, str(path)) for a in argv]
    assert cs.run_cli(local[1:]).code == 0
    first = path.read_text()
    assert len(first.strip()) == 64 and int(first, 16) >= 0
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert cs.run_cli(local[1:]).code == 0 and path.read_text() == first  # a restart keeps it
    assert cs.run_cli([*local[1:], "--rotate"]).code == 0 and path.read_text() != first


def _flag(service, flag: str) -> list[str]:
    """The compose command line's own --flag=VALUE element(s)."""
    return [a for a in cs.service_argv(service) if a.startswith(flag + "=")]


def test_verifier_refuses_sessions_without_the_token(tmp_path, tiny_llama):
    services = _services()
    path = tmp_path / "internal-token"
    assert cs.run_cli(["token", str(path)]).code == 0
    local = lambda args: [a.replace(cs.INTERNAL_TOKEN, str(path)) for a in args]  # noqa: E731
    vport, gport = free_port(), free_port()
    verifier = ServiceProcess("verifier", ["verifier", "--model", str(tiny_llama), "--port", str(vport), *TINY_ENGINE,
                                           *local(_flag(services["verifier"], "--auth-token-file"))], tmp_path, vport)
    gateway = None
    try:
        verifier.wait_serving()  # health stays open without the token (compose's healthcheck)
        address = f"127.0.0.1:{vport}"
        with channel(address) as ch:
            stub = verifier_pb2_grpc.VerifierStub(ch)
            with pytest.raises(grpc.RpcError) as err:
                stub.GetInfo(common_pb2.InfoRequest(), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Session(iter([verifier_pb2.VerifierRequest()]), timeout=5))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with channel(address, ClientSecurity(auth_token_file=str(path))) as ch:
            assert verifier_pb2_grpc.VerifierStub(ch).GetInfo(common_pb2.InfoRequest(), timeout=5).model
        gateway = ServiceProcess("gateway", ["gateway", "--verifier", address, "--port", str(gport),
                                             *local(_flag(services["gateway"], "--internal-auth-token-file"))],
                                 tmp_path, gport)
        gateway.wait_serving()
        assert health(gateway.address) == "SERVING"
        assert generate(gateway.address, request([5, 6, 7], max_tokens=3), timeout=60)["finish_reason"] == "length"
    finally:
        if gateway is not None:
            gateway.stop()
        verifier.stop()


@pytest.mark.parametrize("name", ["gateway", "colocated"])
def test_the_published_server_requires_the_public_token_from_the_environment(name):
    """The gateway and the colocated server publish a port: each requires a bearer token of its
    own, taken from SPECSPLIT_API_TOKEN (never the internal one), and refuses to start without it."""
    from specsplit.cli.common import validate_security

    service = _services({cs.API_TOKEN_ENV: "public"})[name]
    args = _args(service)
    assert args.auth_token_env == cs.API_TOKEN_ENV and args.auth_token_file is None
    assert service["environment"][cs.API_TOKEN_ENV] == "public"
    assert "ports" in service
    assert _services()[name]["environment"][cs.API_TOKEN_ENV] == ""  # unset: empty, and then...
    saved = os.environ.pop(cs.API_TOKEN_ENV, None)
    try:
        with pytest.raises(ValueError, match=f"{cs.API_TOKEN_ENV} .*unset or empty"):
            validate_security(args)  # ...the server refuses to start
    finally:
        if saved is not None:
            os.environ[cs.API_TOKEN_ENV] = saved
