"""tools/step_profile.py end to end on the shipped GGUF: served decode steps are timed part by part,
the parts nest (a part never takes longer than the part that holds it), prefill steps are left
out, and the wrapped methods are restored afterwards."""
from __future__ import annotations

import re

import pytest

from tests.helpers.gguf import NEEDS_GGUF, NEEDS_QUANT_KERNEL
from tests.helpers.tools import load_tool, run_tool


def _parts(stdout: str) -> dict[str, float]:
    return {label.strip(): float(ms) for label, ms in re.findall(r"^(\s*\S[^\d\n]*?)\s+([\d.]+) ms", stdout, re.M)}


@NEEDS_GGUF
@NEEDS_QUANT_KERNEL
@pytest.mark.parametrize("draft", ["none", "smollm2-135m-eagle3"])
def test_decode_steps_are_timed_part_by_part(draft):
    # a fixed K: the K policy may choose to draft nothing in so few steps (it did under CI's load)
    fixed = ("--fixed-k", "2") if draft != "none" else ()
    out = run_tool("step_profile.py", "--draft", draft, "--num-prompts", "1", "--new-tokens", "8", "--rounds", "1",
                   *fixed)
    assert out.returncode == 0, out.stderr[-3000:]
    steps = int(re.search(r"^(\d+) decode steps", out.stdout, re.M).group(1))
    assert 0 < steps <= 7, out.stdout  # 7 tokens after the prefill's: at most 7 decode steps, the prefill left out
    parts = _parts(out.stdout)
    assert parts["step"] >= parts["verify"] >= parts["forward"] >= parts["layer stack"] > 0, out.stdout
    if draft != "none":
        assert parts["step"] >= parts["propose"] > 0, out.stdout


def test_the_timer_restores_what_it_wrapped():
    tool = load_tool("step_profile")
    before = [owner.__dict__[name] for _, owner, name in tool.PARTS]
    with tool.StepTimer():
        assert all(owner.__dict__[name] is not fn for (_, owner, name), fn in zip(tool.PARTS, before))
    assert [owner.__dict__[name] for _, owner, name in tool.PARTS] == before
