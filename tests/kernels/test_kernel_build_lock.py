"""A process killed while compiling a kernel leaves torch's build lock behind, and every later build
of that extension would wait on it forever (seen: a killed test run hung the next one). The loaders
remove a lock older than any build (kernels/cpu_build.py clear_stale_build_lock)."""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from torch.utils.cpp_extension import _get_build_directory

from specsplit.kernels.cpu_build import clear_stale_build_lock


def test_a_stale_lock_is_removed_and_a_fresh_one_kept():
    name = f"specsplit_lock_test_{os.getpid()}"
    directory = Path(_get_build_directory(name, verbose=False))
    try:
        lock = directory / "lock"
        lock.touch()
        os.utime(lock, (time.time() - 3600,) * 2)  # an hour old: no build takes that long
        clear_stale_build_lock(name)
        assert not lock.exists()
        lock.touch()  # a build in progress right now
        clear_stale_build_lock(name)
        assert lock.exists()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
