"""lm-eval's `local-completions` against a live `specsplit serve` (SmolLM2-135M, n-gram drafts):
tools/lm_eval_compare.py runs the committed multiple-choice (loglikelihood: echo + logprobs) and
generate_until tasks and checks every loglikelihood against transformers within 1e-3 and every
greedy generation equal, one prompt per request and a batch of 8. Runs where lm-eval is installed: in this Python (`pip install -e
'.[eval]'`) or in the one $LM_EVAL_PYTHON names (`make eval` makes a venv of its own); nothing is
downloaded at run time."""
from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest

from tests.helpers.tools import load_tool

pytestmark = [pytest.mark.smollm, pytest.mark.slow]

LM_EVAL_PYTHON = os.environ.get("LM_EVAL_PYTHON") or (sys.executable if importlib.util.find_spec("lm_eval") else None)


@pytest.mark.skipif(LM_EVAL_PYTHON is None, reason="lm-eval is not installed (pip install -e '.[eval]', or set "
                    "LM_EVAL_PYTHON to a Python that has it: make eval)")
@pytest.mark.parametrize("batch_size", [1, 8])  # 8: a batch of prompts per /v1/completions request
def test_lm_eval_loglikelihoods_equal_transformers(tmp_path, batch_size):
    compare = load_tool("lm_eval_compare")
    out = tmp_path / "report.json"
    rc = compare.main(["--lm-eval-python", LM_EVAL_PYTHON, "--keep", str(tmp_path / "run"), "--out", str(out),
                       "--batch-size", str(batch_size)])
    report = json.loads(out.read_text())
    assert report["loglikelihoods"] == 4 * 16 and report["generations"] == 8
    assert report["max_abs_diff"] <= 1e-3 and report["generations_differing"] == []
    assert report["is_greedy_flips"] == 0 and rc == 0
