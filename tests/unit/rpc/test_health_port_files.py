"""The file a service started with --port 0 --port-file writes once it serves, and how a
supervisor (`specsplit up`, gateway/launch.py) waits for it: whole or not at all, the child's exit
or a timeout an error naming the child, a stop request an early None. (The real services writing
it: tests/services/test_services_port_file.py.)"""
from __future__ import annotations

import subprocess
import sys

import pytest

from specsplit.rpc.health import wait_written
from specsplit.rpc.serving import write_port_file


def _sleeper(seconds: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"])


def test_the_port_file_holds_the_port_and_nothing_beside_it(tmp_path):
    path = tmp_path / "svc.port"
    write_port_file(str(path), 50123)
    write_port_file(str(path), 50124)  # a restart over an old file: replaced, not appended
    assert path.read_text() == "50124\n" and [p.name for p in tmp_path.iterdir()] == ["svc.port"]


def test_an_unwritable_port_file_is_an_error_naming_the_flag(tmp_path):
    with pytest.raises(RuntimeError, match=r"--port-file .*missing"):
        write_port_file(str(tmp_path / "missing" / "svc.port"), 1)


def test_waiting_returns_what_the_child_wrote(tmp_path):
    path = tmp_path / "svc.port"
    proc = subprocess.Popen([sys.executable, "-c", "import sys, time; from specsplit.rpc.serving import write_port_file; "
                             f"time.sleep(0.5); write_port_file({str(path)!r}, 4242); time.sleep(30)"])
    try:
        assert wait_written("verifier", proc, str(path), timeout=60) == "4242"
    finally:
        proc.kill()
        proc.wait()


def test_a_child_that_exits_first_or_stays_silent_is_an_error_naming_it(tmp_path):
    quitter = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    with pytest.raises(RuntimeError, match=r"drafter exited with code 3 during start-up; see its log"):
        wait_written("drafter", quitter, str(tmp_path / "d.port"), timeout=60, describe=lambda: "; see its log")
    silent = _sleeper(30)
    try:
        with pytest.raises(RuntimeError, match=r"gateway not SERVING after 0s"):
            wait_written("gateway", silent, str(tmp_path / "g.port"), timeout=0.3)
        assert wait_written("gateway", silent, str(tmp_path / "g.port"), timeout=60, stop_requested=lambda: True) is None
    finally:
        silent.kill()
        silent.wait()


def test_free_port_runs_are_below_the_kernel_s_range_and_bindable():
    """What a tool hands `up --metrics-port`: n consecutive ports free now, none the kernel can give
    an engine that binds port 0 (CI once saw a gateway's metrics port taken by its drafter)."""
    import socket

    from specsplit.rpc.health import bindable, ephemeral_low, free_port_run

    for _ in range(5):
        first = free_port_run(3)
        assert 20000 <= first and first + 2 < ephemeral_low()
        assert all(bindable("127.0.0.1", first + j) for j in range(3))
    held = socket.socket()
    held.bind(("127.0.0.1", free_port_run(1)))
    try:
        assert not bindable("127.0.0.1", held.getsockname()[1])
    finally:
        held.close()
