"""Finding processes a test left behind: tensor-parallel workers (python -m specsplit.parallel.worker)."""
from __future__ import annotations

import time

import psutil

WORKER_MODULE = "specsplit.parallel.worker"


def live(pid: int) -> bool:
    """Running, not a zombie (a zombie holds no memory and no sockets; its parent reaps it)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def tp_workers(parent: int | None = None) -> list[int]:
    """Pids of live tensor-parallel workers (children of `parent`, if given, recursively)."""
    if parent is not None:
        try:
            procs = psutil.Process(parent).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
    else:
        procs = psutil.process_iter()
    out = []
    for p in procs:
        try:
            if WORKER_MODULE in " ".join(p.cmdline()) and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def assert_gone(pids, within_s: float = 10.0) -> None:
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        left = [p for p in pids if live(p)]
        if not left:
            return
        time.sleep(0.05)
    raise AssertionError(f"tensor-parallel workers still running after {within_s:g}s: {left}")
