"""Running a script of tools/ as a user would: its own process, from the repository root, one
torch thread."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_tool(name: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python tools/<name> args...`; its stdout and stderr captured as text."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, f"tools/{name}", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
