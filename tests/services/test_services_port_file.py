"""A real service started with --port 0 --port-file binds a port of its own choosing and, once it
serves, writes that port to the file: where its health check answers SERVING. This is how `specsplit
up` starts its children (tests/e2e/test_up_*.py run it whole)."""
from __future__ import annotations

from tests.services.procs import HOST, ServiceProcess, health


def test_a_service_on_port_0_writes_the_port_it_serves_on(tmp_path):
    from specsplit.rpc.health import wait_written

    path = tmp_path / "drafter.port"
    svc = ServiceProcess("drafter", ["drafter", "--model", "ngram", "--port", "0", "--port-file", str(path)], tmp_path)
    try:
        port = int(wait_written("drafter", svc.proc, str(path), timeout=120, describe=lambda: ":\n" + svc.log_tail()))
        assert port > 0 and path.read_text() == f"{port}\n"
        assert health(f"{HOST}:{port}") == "SERVING"
        assert f"listening on {HOST}:{port}" in svc.log_tail()
    finally:
        assert svc.stop() == 0
