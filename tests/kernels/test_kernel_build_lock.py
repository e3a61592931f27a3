"""A process killed while compiling a kernel leaves torch's build lock behind, and every later build
of that extension would wait on it forever (seen: a killed test run hung the next one). The loaders
build under an flock of their own (kernels/cpu_build.py build_guard): the kernel releases it when
its holder dies, so a torch lock found while holding it is a leftover, however fresh, and goes;
a live builder is waited for."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from torch.utils.cpp_extension import _get_build_directory

from specsplit.kernels.cpu_build import build_guard


@pytest.fixture
def build_dir():
    name = f"specsplit_lock_test_{os.getpid()}"
    directory = Path(_get_build_directory(name, verbose=False))
    yield name, directory
    shutil.rmtree(directory, ignore_errors=True)


def test_a_killed_builds_lock_is_removed_even_when_fresh(build_dir):
    name, directory = build_dir
    lock = directory / "lock"
    lock.touch()  # just now, by a build that was then killed: nobody holds the guard
    with build_guard(name):
        assert not lock.exists()


def test_a_live_builder_is_waited_for_and_its_lock_kept(build_dir):
    """Another process holds the guard and torch's lock (it is compiling): ours waits until it
    has released both, and never removes a live builder's lock."""
    name, directory = build_dir
    released = directory / "released"
    child = subprocess.Popen([sys.executable, "-c", f"""
import sys, time
from specsplit.kernels.cpu_build import build_guard
from pathlib import Path
d = Path({str(directory)!r})
with build_guard({name!r}):
    (d / "lock").touch()  # compiling
    print("holding", flush=True)
    sys.stdin.readline()  # until the test lets go
    (d / "lock").unlink()
    (d / "released").touch()
"""], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "holding"
        assert (directory / "lock").exists()
        child.stdin.write("\n")
        child.stdin.flush()
        with build_guard(name):  # entered only once the child let go: its marker is there
            assert released.exists()
        assert child.wait(timeout=60) == 0
    finally:
        child.kill()
        child.wait()


def test_a_killed_holder_releases_the_guard(build_dir):
    """A builder killed while holding the guard (and leaving torch's lock) does not block the next."""
    name, directory = build_dir
    child = subprocess.Popen([sys.executable, "-c", f"""
import time
from specsplit.kernels.cpu_build import build_guard
from pathlib import Path
with build_guard({name!r}):
    (Path({str(directory)!r}) / "lock").touch()
    print("holding", flush=True)
    time.sleep(600)
"""], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "holding"
    finally:
        child.kill()
        child.wait()
    assert (directory / "lock").exists()  # left behind
    with build_guard(name):
        assert not (directory / "lock").exists()
