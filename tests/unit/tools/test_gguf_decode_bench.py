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


@NEEDS_GGUF
@NEEDS_QUANT_KERNEL
def test_decode_at_depth_computes_the_context_in_pieces_and_reports_a_rate():
    """--depth 600: the context goes in as two pieces (512 + 88) before the prompt, then the decode."""
    out = run_tool("gguf_decode_bench.py", "--weights", "native", "--rounds", "1", "--tokens", "4", "--depth", "600")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "decode 4 tokens after 600 tokens of context" in out.stdout, out.stdout
    rates = dict(re.findall(r"^\s+(\S.*?)\s+([\d.]+) tok/s", out.stdout, re.M))
    assert set(rates) == {"native"} and float(rates["native"]) > 0, out.stdout
