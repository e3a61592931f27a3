"""rpc/metrics.py's reader: a live /metrics page, parsed by name and labels (what the tools and
the service tests read a stack's counters with)."""
from __future__ import annotations

from prometheus_client import start_http_server

from specsplit.rpc import metrics
from specsplit.rpc.health import free_ports


def test_parse_keeps_names_with_labels_and_skips_comments():
    page = "# HELP x help\n# TYPE x counter\nx_total 3.0\n\ny_seconds_sum{phase=\"draft\"} 0.25\n"
    assert metrics.parse_metrics(page) == {"x_total": 3.0, 'y_seconds_sum{phase="draft"}': 0.25}


def test_read_metrics_reads_this_process_s_registry_over_http():
    port = free_ports(1, "127.0.0.1")[0]
    httpd, thread = start_http_server(port, addr="127.0.0.1")  # what start_metrics_server serves
    try:
        before = metrics.read_metrics(port).get('specsplit_steps_total{k="3"}', 0.0)
        metrics.STEPS.labels("3").inc(2)
        assert metrics.read_metrics(port)['specsplit_steps_total{k="3"}'] == before + 2
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)


def test_a_metrics_port_in_use_is_a_runtime_error_naming_the_flag():
    """The CLI prints a RuntimeError as one line and exits 1 (a bare OSError was a traceback)."""
    import socket

    import pytest

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(RuntimeError, match=rf"127\.0\.0\.1:{port} .*--metrics-port"):
            metrics.start_metrics_server("127.0.0.1", port)
