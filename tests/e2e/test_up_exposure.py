"""`specsplit up --host 0.0.0.0` publishes the gateway alone: the engines listen on loopback only
(--engine-host) and require an internal token made for the run, never the public one; the public
GetServerInfo names no engine address. Real processes: `up` with the tiny target + n-gram drafter."""
from __future__ import annotations

import re

import grpc
import pytest

from specsplit.rpc.security import ClientSecurity, channel
from specsplit.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, verifier_pb2_grpc
from tests.services.procs import REPO, TINY_ENGINE

TOKEN = "public-up-token"


def _listening(port: int) -> set[str]:
    """The local addresses (hex, as /proc/net/tcp* writes them) with a socket listening on `port`."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            local, state = row.split()[1], row.split()[3]
            address, _, hex_port = local.rpartition(":")
            if state == "0A" and int(hex_port, 16) == port:
                out.add(address)
    return out


LOOPBACK = {"0100007F", "0000000000000000FFFF00000100007F"}  # 127.0.0.1, and as an IPv4-mapped IPv6 address
ANY = {"00000000", "00000000000000000000000000000000"}


@pytest.fixture(scope="module")
def exposed_up(tmp_path_factory, tiny_llama):
    from specsplit.gateway.launch import specsplit_up

    root = tmp_path_factory.mktemp("up-exposure")
    token_file = root / "token"
    token_file.write_text(TOKEN + "\n")
    env = dict(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    with specsplit_up(str(tiny_llama), "ngram", max_num_seqs=2, host="0.0.0.0", log=root / "up.log", env=env,
                      cwd=REPO, log_level="INFO", startup_timeout=240,
                      extra=[*TINY_ENGINE, "--auth-token-file", str(token_file)]) as stack:
        stack.token_file = token_file
        yield stack


def test_only_the_gateway_listens_on_every_interface(exposed_up):
    gateway_port = int(exposed_up.address.rpartition(":")[2])
    assert _listening(gateway_port) & ANY, _listening(gateway_port)
    for name in ("drafter", "verifier"):
        port = int(exposed_up.addresses[name].rpartition(":")[2])
        assert _listening(port) and _listening(port) <= LOOPBACK, f"{name} must bind loopback only: {_listening(port)}"


def test_the_engines_refuse_the_public_token(exposed_up):
    public = ClientSecurity(auth_token_file=str(exposed_up.token_file))
    for security in (None, public):
        with channel(exposed_up.verifier, security) as ch, pytest.raises(grpc.RpcError) as err:
            verifier_pb2_grpc.VerifierStub(ch).GetInfo(common_pb2.InfoRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_the_gateway_serves_with_the_public_token_and_hides_the_engines(exposed_up):
    gateway = "127.0.0.1:" + exposed_up.address.rpartition(":")[2]
    with channel(gateway, ClientSecurity(auth_token_file=str(exposed_up.token_file))) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        info = stub.GetServerInfo(gateway_pb2.GetServerInfoRequest(), timeout=10)
        out = list(stub.Generate(gateway_pb2.GenerateRequest(prompt_token_ids=[5, 9, 13, 5, 9], max_tokens=4,
                                                             ignore_eos=True), timeout=120))
    assert sum(len(r.token_ids) for r in out) == 4  # the gateway reached both engines with the internal token
    assert {s.name for s in info.services} == {"verifier", "drafter"}
    assert all(s.reachable and s.address == "" for s in info.services)
    # the port as a number of its own (a float's digits, e.g. a verify cost's 0.0004313001581467690,
    # may hold any five digits: CI saw this check fail that way)
    port = exposed_up.verifier.rpartition(":")[2]
    assert re.search(rf"(?<![\d.]){port}(?!\d)", str(info)) is None, str(info)
