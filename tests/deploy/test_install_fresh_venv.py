"""The project installs (a real wheel, not editable) into a fresh venv beside the newest
transformers and PyPI's `kernels` package (which current transformers requires, and whose import
name our kernels once shadowed), and generates. Every import name of ours is under specsplit.*.
The install (and a first generation, which compiles our CPU kernels) runs in the background from
the start of the session and this test runs last (tests/deploy/fresh_venv.py)."""
from __future__ import annotations

import json
import subprocess
import time

import pytest

from tests.deploy.fresh_venv import GENERATE, REGISTRY_DOWN, STEPS

pytestmark = pytest.mark.slow


def test_wheel_installs_beside_newest_transformers_and_kernels(fresh_venv_install, tmp_path):
    t0 = time.monotonic()
    steps = fresh_venv_install.wait(timeout=1800)  # tests/deploy/fresh_venv.py: started with the session
    waited = time.monotonic() - t0
    assert steps, f"the fresh-venv install wrote no status: creating the venv failed:\n{fresh_venv_install.log_tail()}"
    for step in steps:
        if step["rc"] != 0 and any(why in step["stderr"] for why in REGISTRY_DOWN):
            pytest.skip(f"the package registry cannot serve {step['name']}: {step['stderr'].strip().splitlines()[-1]}")
        assert step["rc"] == 0, f"{' '.join(step['cmd'])}:\n{step['stderr']}"
    assert len(steps) == len(STEPS) + 1, fresh_venv_install.log_tail()  # the installs, then the warm-up generation
    venv, t0 = fresh_venv_install.venv, time.monotonic()
    py = str(venv / "bin" / "python")
    probe = subprocess.run([py, "-c", "import json, kernels, specsplit.kernels, transformers, specsplit.v1.gateway_pb2; "
                                      "print(json.dumps([kernels.__file__, specsplit.kernels.__file__, transformers.__version__]))"],
                           capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert probe.returncode == 0, probe.stderr
    theirs, ours, version = json.loads(probe.stdout.strip().splitlines()[-1])
    assert "site-packages/kernels/" in theirs and "site-packages/specsplit/kernels/" in ours, (theirs, ours)
    # the warm-up's kernel builds (fresh_venv.GENERATE) are in the install's folder: env names it
    gen = subprocess.run([str(venv / "bin" / "specsplit"), *GENERATE], capture_output=True, text=True, timeout=900,
                         cwd=tmp_path, env=fresh_venv_install.env())
    assert gen.returncode == 0, gen.stderr[-3000:]
    result = json.loads(gen.stdout.strip().splitlines()[-1])
    assert len(result["token_ids"]) == 8 and result["text"].strip(), result
    checked = time.monotonic() - t0
    took = ", ".join(f"{s['name'][-40:]} {s['seconds']} s ({s['cpu_seconds']} s CPU)" for s in steps)
    install = fresh_venv_install.result()
    print(f"FIGURE fresh venv: transformers {version}, PyPI kernels at {theirs}; generated {result['text']!r}; "
          f"install in the background at nice {install['nice']} ({install['nice_at_end']} at its end): "
          f"{install['seconds']} s ({install['cpu_seconds']} s CPU), of which this test waited {waited:.1f} s, then "
          f"checked the venv in {checked:.1f} s; steps: {took}")
