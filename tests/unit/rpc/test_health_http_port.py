"""A gRPC client pointed at an HTTP/1.x port (the OpenAI API's --http-port is the likely mix-up)
is told so, with the flag to use: `specsplit health` and `specsplit generate --server`, against a
real HTTP server on loopback."""
from __future__ import annotations

import http.server
import threading

import pytest

from specsplit.cli import main
from specsplit.rpc.health import HTTP1_HINT, check, error_text


@pytest.fixture
def http_port():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def test_health_of_an_http_port_says_what_it_is(http_port):
    status = check(f"127.0.0.1:{http_port}", timeout=5)
    assert status.startswith("UNREACHABLE: ") and status.endswith(HTTP1_HINT), status


def test_generate_against_an_http_port_says_what_it_is(http_port, capsys):
    assert main(["generate", "--server", f"127.0.0.1:{http_port}", "--prompt-token-ids", "1,2", "--max-tokens", "2",
                 "--timeout", "5"]) == 1
    assert HTTP1_HINT in capsys.readouterr().err


def test_other_errors_keep_their_text():
    class Refused:
        def code(self):
            import grpc
            return grpc.StatusCode.UNAVAILABLE

        def details(self):
            return "failed to connect to all addresses; last error: Connection refused"

    assert error_text(Refused()) == "UNAVAILABLE: failed to connect to all addresses; last error: Connection refused"
    assert error_text(ValueError("x")) == "x"
