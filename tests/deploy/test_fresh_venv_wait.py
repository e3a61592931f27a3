"""How a waiter learns that the background fresh-venv install (tests/deploy/fresh_venv.py) has
ended: under pytest-xdist the worker that waits is not the process that started it, so it polls
the install's folder for `done`, which the script writes last whatever happened."""
from __future__ import annotations

import json
import os
import subprocess
import threading
import time

import pytest

from tests.deploy.fresh_venv import Install


def test_a_waiter_returns_the_steps_once_done_is_written(tmp_path):
    steps = [{"name": "pip install torch==2.13.0", "rc": 0, "stderr": "", "seconds": 1.0, "cpu_seconds": 0.5}]
    (tmp_path / "status.json").write_text(json.dumps(steps))  # a step is written before the install ends
    finish = threading.Timer(0.3, lambda: (tmp_path / "done").write_text(json.dumps({"rc": 0})))
    finish.start()
    t0 = time.monotonic()
    assert Install(tmp_path).wait(timeout=30) == steps
    assert time.monotonic() - t0 >= 0.3
    finish.join()


def test_a_waiter_times_out_naming_the_folder(tmp_path):
    with pytest.raises(TimeoutError, match="did not finish within"):
        Install(tmp_path).wait(timeout=0.1)


def test_the_owner_sees_an_install_that_ended_without_done(tmp_path):
    proc = subprocess.Popen(["true"])
    proc.wait()
    with pytest.raises(RuntimeError, match="without finishing"):
        Install(tmp_path, proc).wait(timeout=30)


def test_the_script_writes_done_when_the_venv_cannot_be_created(tmp_path):
    root = tmp_path / "install"
    root.mkdir()
    (root / "venv").write_text("a file where the venv goes")
    install = Install(root)
    install.start(tmp_path)
    try:
        assert install.wait(timeout=60) == []
        assert install.result()["rc"] == 1
        assert "Traceback" in install.log_tail()
    finally:
        install.close()


def test_hurry_puts_a_niced_install_back_to_nice_0_where_permitted(tmp_path):
    proc = subprocess.Popen(["nice", "-n", "19", "sleep", "30"], start_new_session=True)
    try:
        (tmp_path / "pgid").write_text(str(proc.pid))
        hurried = Install(tmp_path).hurry()
        assert os.getpriority(os.PRIO_PROCESS, proc.pid) == (0 if hurried else 19)
        assert hurried or os.geteuid() != 0
    finally:
        proc.kill()
        proc.wait()
