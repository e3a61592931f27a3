"""tools/split_streams_check.py end to end on a real split stack (`specsplit up`, the shipped
models): both arms report a rate and the stack's counters over their own batches, and the
speculative arm's steps are the ones the policy labelled with a K."""
from __future__ import annotations

import json

from tests.helpers.gguf import NEEDS_GGUF, NEEDS_QUANT_KERNEL
from tests.helpers.tools import load_tool, run_tool


def test_counters_are_parsed_by_name_and_labels_and_differenced():
    tool = load_tool("split_streams_check")
    page = "\n".join([
        "# HELP specsplit_steps_total steps",
        'specsplit_steps_total{k="0"} 12.0',
        'specsplit_steps_total{k="1"} 3.0',
        'specsplit_step_seconds_sum{phase="verify"} 0.5',
        'specsplit_step_seconds_bucket{le="0.1",phase="verify"} 4.0',  # not a counter we sum
        'specsplit_engine_seconds_count{op="verify",service="verifier"} 15.0',
    ])
    got = tool.parse_counters(page)
    assert got == {'specsplit_steps_total{k="0"}': 12.0, 'specsplit_steps_total{k="1"}': 3.0,
                   'specsplit_step_seconds_sum{phase="verify"}': 0.5,
                   'specsplit_engine_seconds_count{op="verify",service="verifier"}': 15.0}
    later = dict(got, **{'specsplit_steps_total{k="0"}': 20.0, 'specsplit_steps_total{k="2"}': 1.0})
    assert tool.delta(later, got) == {'specsplit_steps_total{k="0"}': 8.0, 'specsplit_steps_total{k="2"}': 1.0}


@NEEDS_GGUF
@NEEDS_QUANT_KERNEL
def test_both_arms_report_rates_and_their_own_counters():
    out = run_tool("split_streams_check.py", "--streams", "2", "--batches", "1", "--rounds", "1", "--new-tokens", "6")
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    spec, base = report["arms"]["speculative"], report["arms"]["target-only"]
    assert spec["tokens"] == base["tokens"] == 12 and spec["tokens_per_s"] > 0 and base["tokens_per_s"] > 0
    assert report["speculative_vs_target_only"] > 0
    for arm in (spec, base):
        steps = sum(v for k, v in arm["counters"].items() if k.startswith("specsplit_steps_total"))
        assert steps == arm["counters"]['specsplit_step_seconds_count{phase="total"}'] > 0
    assert not any("k=\"1\"" in k or "k=\"2\"" in k for k in base["counters"])  # disabled: K = 0 only
