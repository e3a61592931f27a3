"""tools/gguf_decode_bench.py end to end on the shipped GGUF (no llama-bench here): the raw decode
arms per weights mode and the served arms (target alone, default draft and flags) each report a
rate, and the weights modes decode the same greedy tokens."""
from __future__ import annotations

import re

from tests.helpers.gguf import NEEDS_GGUF, NEEDS_QUANT_KERNEL
from tests.helpers.tools import run_tool


@NEEDS_GGUF
@NEEDS_QUANT_KERNEL
def test_raw_and_served_arms_report_rates():
    out = run_tool("gguf_decode_bench.py", "--weights", "native,fp32", "--rounds", "1", "--tokens", "6",
                   "--spec-prompts", "1")
    assert out.returncode == 0, out.stderr[-3000:]
    rates = dict(re.findall(r"^\s+(\S.*?)\s+([\d.]+) tok/s", out.stdout, re.M))
    assert set(rates) == {"native", "fp32", "served target-only", "served smollm2-135m-eagle3+ngram"}, out.stdout
    assert all(float(v) > 0 for v in rates.values())
    assert "same greedy tokens across weights modes: True" in out.stdout
