"""TLS, mTLS, the bearer token and --no-reflection, against real processes (the `secure` stack:
every service serves mTLS with a token and no reflection; the gateway reaches its peers over
mTLS with the token) and an n-gram drafter serving plain TLS."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import grpc
import pytest

from specsplit.rpc.security import ClientSecurity, channel
from specsplit.v1 import common_pb2, drafter_pb2_grpc, gateway_pb2, gateway_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from tests.services.procs import REPO, health, request


def _mtls(pki, token_file=None) -> ClientSecurity:
    return ClientSecurity(str(pki.ca), str(pki.client_cert), str(pki.client_key), str(token_file) if token_file else None)


def _info(address: str, security, timeout: float = 5.0):
    with channel(address, security) as ch:
        return gateway_pb2_grpc.GatewayStub(ch).GetServerInfo(gateway_pb2.GetServerInfoRequest(), timeout=timeout)


def _generate(address: str, security, req, timeout: float = 60.0) -> list:
    with channel(address, security) as ch:
        return list(gateway_pb2_grpc.GatewayStub(ch).Generate(req, timeout=timeout))


def _engine_info(address: str, role: str, security):
    stub_cls = drafter_pb2_grpc.DrafterStub if role == "drafter" else verifier_pb2_grpc.VerifierStub
    with channel(address, security) as ch:
        return stub_cls(ch).GetInfo(common_pb2.InfoRequest(), timeout=5)


def _code(fn) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        fn()
    return err.value.code()


def test_mtls_with_token_end_to_end(secure_stack, pki, prompts):
    pki, token = pki
    responses = _generate(secure_stack.gateway, _mtls(pki, token), request(prompts[0], max_tokens=12, ignore_eos=True))
    last = responses[-1]
    assert last.finish_reason == "length" and last.usage.completion_tokens == 12
    # Speculation ran: the gateway reached the drafter and the verifier over mTLS with the token.
    assert last.usage.proposed_draft_tokens > 0
    info = _info(secure_stack.gateway, _mtls(pki, token))
    assert {s.name: s.reachable for s in info.services} == {"verifier": True, "drafter": True}
    for name in ("verifier", "drafter"):
        assert _engine_info(secure_stack[name].address, name, _mtls(pki, token)).role == name
    print("FIGURE tls: mTLS + token end to end: 12 tokens, "
          f"{last.usage.accepted_draft_tokens}/{last.usage.proposed_draft_tokens} drafts accepted")


def test_plaintext_client_to_tls_server_fails(secure_stack, tls_drafter, pki):
    pki, token = pki
    for name in ("gateway", "verifier", "drafter"):
        addr = secure_stack[name].address
        if name == "gateway":
            code = _code(lambda: _info(addr, ClientSecurity(auth_token_file=str(token)), timeout=3))
        else:
            code = _code(lambda: _engine_info(addr, name, ClientSecurity(auth_token_file=str(token))))
        assert code == grpc.StatusCode.UNAVAILABLE, name
    assert _code(lambda: _engine_info(tls_drafter.address, "drafter", None)) == grpc.StatusCode.UNAVAILABLE


def test_tls_only_server_works_without_client_cert(tls_drafter, pki):
    pki, _ = pki
    assert _engine_info(tls_drafter.address, "drafter", ClientSecurity(str(pki.ca))).model == "ngram"
    assert health(tls_drafter.address, security=ClientSecurity(str(pki.ca))) == "SERVING"
    # A CA that did not sign the server's certificate: the handshake fails.
    other = make_other_ca(pki.ca.parent.parent / "other-pki")
    assert _code(lambda: _engine_info(tls_drafter.address, "drafter", ClientSecurity(str(other)))) == grpc.StatusCode.UNAVAILABLE


def make_other_ca(directory):
    from tests.reliability.certs import make_pki

    return make_pki(directory).ca


def test_mtls_without_client_cert_fails(secure_stack, pki):
    pki, token = pki
    no_cert = ClientSecurity(str(pki.ca), auth_token_file=str(token))
    assert _code(lambda: _info(secure_stack.gateway, no_cert, timeout=3)) == grpc.StatusCode.UNAVAILABLE
    for name in ("verifier", "drafter"):
        assert _code(lambda: _engine_info(secure_stack[name].address, name, no_cert)) == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("token", [None, "wrong-token"])
def test_missing_or_wrong_token_is_unauthenticated(secure_stack, pki, prompts, tmp_path, token):
    pki, _ = pki
    token_file = None
    if token is not None:
        token_file = tmp_path / "bad-token"
        token_file.write_text(token)
    sec = _mtls(pki, token_file)
    # unary
    err = _code(lambda: _info(secure_stack.gateway, sec))
    assert err == grpc.StatusCode.UNAUTHENTICATED
    # server streaming
    assert _code(lambda: _generate(secure_stack.gateway, sec, request(prompts[1], max_tokens=4))) == grpc.StatusCode.UNAUTHENTICATED
    # unary and bidi streaming on the internal services
    for name in ("verifier", "drafter"):
        assert _code(lambda: _engine_info(secure_stack[name].address, name, sec)) == grpc.StatusCode.UNAUTHENTICATED
    with channel(secure_stack["verifier"].address, sec) as ch:
        call = verifier_pb2_grpc.VerifierStub(ch).Session(iter([verifier_pb2.VerifierRequest(id=1)]), timeout=5)
        assert _code(lambda: list(call)) == grpc.StatusCode.UNAUTHENTICATED
    # Health stays open (probes carry no secret).
    assert health(secure_stack.gateway, security=sec) == "SERVING"


def test_reflection_off_is_unimplemented(secure_stack, pki):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    pki, token = pki
    for name in ("gateway", "verifier", "drafter"):
        with channel(secure_stack[name].address, _mtls(pki, token)) as ch:
            stub = reflection_pb2_grpc.ServerReflectionStub(ch)
            call = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
            assert _code(lambda: list(call)) == grpc.StatusCode.UNIMPLEMENTED, name


def _cli(*argv: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "specsplit.cli", *argv], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=env)


def test_cli_health_and_generate_over_mtls(secure_stack, pki):
    pki, token = pki
    tls = ["--tls-ca", str(pki.ca), "--tls-cert", str(pki.client_cert), "--tls-key", str(pki.client_key)]
    out = _cli("health", secure_stack.gateway, *tls)
    assert out.returncode == 0 and "SERVING" in out.stdout, out.stderr
    assert _cli("health", secure_stack.gateway).returncode == 1  # plaintext to a TLS server
    ok = _cli("generate", "--server", secure_stack.gateway, "--prompt-token-ids", "5,6,7", "--max-tokens", "5",
              "--ignore-eos", "--json", *tls, "--auth-token-file", str(token))
    assert ok.returncode == 0, ok.stderr
    assert len(json.loads(ok.stdout)["token_ids"]) == 5
    denied = _cli("generate", "--server", secure_stack.gateway, "--prompt-token-ids", "5,6,7", "--max-tokens", "5",
                  "--json", *tls)
    assert denied.returncode == 1 and "UNAUTHENTICATED" in denied.stderr, denied.stderr



def _https(stack, pki, path: str, body: dict | None = None, token: str | None = None, client_cert: bool = True):
    """(status, JSON) of the gateway's HTTP API over HTTPS, verified with the test CA."""
    import ssl
    import urllib.error
    import urllib.request

    ctx = ssl.create_default_context(cafile=str(pki.ca))
    if client_cert:
        ctx.load_cert_chain(str(pki.client_cert), str(pki.client_key))
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(f"https://127.0.0.1:{stack.http_port}{path}",
                                 data=None if body is None else json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10, context=ctx) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_http_api_serves_https_with_mtls_and_the_token(secure_stack, pki, prompts):
    """The gateway's --http-port takes the gRPC API's certificate, client CA and bearer token."""
    import ssl
    import urllib.error
    import urllib.request

    pki, token_file = pki
    token = token_file.read_text().strip()
    status, models = _https(secure_stack, pki, "/v1/models", token=token)
    assert status == 200
    body = {"model": models["data"][0]["id"], "prompt": list(prompts[0]), "max_tokens": 6, "temperature": 0,
            "ignore_eos": True}
    status, res = _https(secure_stack, pki, "/v1/completions", body, token=token)
    assert status == 200 and res["usage"]["completion_tokens"] == 6
    status, res = _https(secure_stack, pki, "/v1/completions", body, token="wrong-token")
    assert status == 401 and res["error"]["code"] == "invalid_api_key"
    assert _https(secure_stack, pki, "/health") == (200, {"status": "ok"})  # open, like gRPC health
    with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):  # mTLS: no client certificate
        _https(secure_stack, pki, "/health", client_cert=False)
    with pytest.raises((urllib.error.URLError, ConnectionError)):  # plaintext to the HTTPS port
        urllib.request.urlopen(f"http://127.0.0.1:{secure_stack.http_port}/health", timeout=5).read()
