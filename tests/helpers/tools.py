"""The scripts of tools/ in tests: run as a user would (their own process, from the repository
root, one torch thread), or loaded as a module to call their functions."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "tools"


def load_tool(name: str) -> ModuleType:
    """tools/<name>.py as a module (tools/ on sys.path first: a tool may import its siblings)."""
    if str(TOOLS) not in sys.path:
        sys.path.insert(0, str(TOOLS))
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_tool(name: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python tools/<name> args...`; its stdout and stderr captured as text. Past `timeout` the
    tool and every process under it are killed (a tool that started services: killed alone, its
    `specsplit up` and the services would be orphans the suite's leftover check cannot see), and
    subprocess.TimeoutExpired is raised with what it printed."""
    import psutil

    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, f"tools/{name}", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        tree = psutil.Process(proc.pid).children(recursive=True)
        for p in [psutil.Process(proc.pid), *tree]:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(tree, timeout=10)
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(proc.args, timeout, out, err) from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
