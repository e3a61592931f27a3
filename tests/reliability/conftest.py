"""Stacks for the reliability suite, all started at once (their start-ups overlap) and shared by
the session; built from tests/services/procs.py.

secure:     drafter + verifier + gateway, each with mTLS (--tls-cert/--tls-key/--tls-ca), a bearer
            token and --no-reflection; the gateway reaches the other two over mTLS with the token,
            and serves its OpenAI-compatible HTTP API too (HTTPS, mTLS, the token)
tls_only:   an n-gram drafter serving plain TLS (no client certificates)
plain:      drafter + verifier + gateway without security, --disable-by-batch-size 4, max_queue 128
faulty:     verifier + gateway, the verifier run by tests/helpers/faulty_verifier.py (verify fails
            after a number of steps, for a while)
The gateways ping their peers every second (--keepalive-time 1, --keepalive-timeout 2).
"""
from __future__ import annotations

import pytest

from specsplit.rpc.security import ClientSecurity
from tests.reliability.certs import make_pki
from tests.services.conftest import prompts  # noqa: F401  (the same random prompts)
from tests.services.procs import HOST, ServiceProcess, free_port, start_split

KEEPALIVE = ("--keepalive-time", "1", "--keepalive-timeout", "2")
FAULT_AFTER_STEPS = 40
FAULT_SECONDS = 6.0
TOKEN = "s3cret-token-for-tests"


@pytest.fixture(scope="session")
def pki(tmp_path_factory):
    pki = make_pki(tmp_path_factory.mktemp("pki"))
    token = pki.ca.parent / "token"
    token.write_text(TOKEN + "\n")
    return pki, token


@pytest.fixture(scope="session")
def rel_servers(tmp_path_factory, tiny_llama, tiny_draft_close, pki):
    pki, token = pki
    server = ["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key), "--tls-ca", str(pki.ca),
              "--auth-token-file", str(token), "--no-reflection"]
    internal = ["--internal-tls-ca", str(pki.ca), "--internal-tls-cert", str(pki.client_cert),
                "--internal-tls-key", str(pki.client_key), "--internal-auth-token-file", str(token)]
    mtls = ClientSecurity(str(pki.ca), str(pki.client_cert), str(pki.client_key))
    tport = free_port()
    stacks = {
        "secure": start_split(tmp_path_factory.mktemp("secure-logs"), tiny_llama, tiny_draft_close, max_num_seqs=4,
                              gateway_extra=(*server, *internal, *KEEPALIVE, "--http-port", str(free_port())),
                              service_extra=tuple(server), security=mtls),
        "plain": start_split(tmp_path_factory.mktemp("plain-logs"), tiny_llama, tiny_draft_close, max_num_seqs=8,
                             max_queue=128, gateway_extra=("--disable-by-batch-size", "4", *KEEPALIVE)),
        "faulty": start_split(tmp_path_factory.mktemp("faulty-logs"), tiny_llama, None, max_num_seqs=4, max_queue=16,
                              gateway_extra=KEEPALIVE,
                              verifier_env={"SPECSPLIT_FAULT_VERIFY_AFTER_STEPS": str(FAULT_AFTER_STEPS),
                                            "SPECSPLIT_FAULT_VERIFY_SECONDS": str(FAULT_SECONDS)},
                              verifier_module="tests.helpers.faulty_verifier"),
    }
    tls_only = ServiceProcess("tls-drafter", ["drafter", "--model", "ngram", "--port", str(tport), "--tls-cert",
                                              str(pki.server_cert), "--tls-key", str(pki.server_key)],
                              tmp_path_factory.mktemp("tls-logs"), tport, security=ClientSecurity(str(pki.ca)))
    try:
        yield stacks, tls_only
    finally:
        for stack in stacks.values():
            stack.stop()
        tls_only.stop()


@pytest.fixture(scope="session")
def secure_stack(rel_servers):
    return rel_servers[0]["secure"].ready()


@pytest.fixture(scope="session")
def plain_stack(rel_servers):
    return rel_servers[0]["plain"].ready()


@pytest.fixture(scope="session")
def faulty_stack(rel_servers):
    return rel_servers[0]["faulty"].ready()


@pytest.fixture(scope="session")
def tls_drafter(rel_servers):
    p = rel_servers[1]
    p.wait_serving(120)
    return p


__all__ = ["HOST"]
