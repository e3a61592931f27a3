"""The suite's own guard (tests/conftest.py, pytest_sessionfinish): a run in which a test leaves a
process running fails, names the process and kills it."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_a_run_that_leaks_a_process_fails(tmp_path):
    leak = tmp_path / "test_leak.py"
    leak.write_text("import subprocess, sys\n\n"
                    "def test_leaks():\n"
                    "    subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)  # leaked-by-test'])\n")
    # the repository's conftest.py applies: run with it as the rootdir's conftest
    (tmp_path / "conftest.py").write_text((REPO / "tests" / "conftest.py").read_text())
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(leak)],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "outlived the suite" in proc.stdout and "leaked-by-test" in proc.stdout
    assert subprocess.run(["pgrep", "-f", "leaked-by-test"], capture_output=True).returncode == 1  # killed
