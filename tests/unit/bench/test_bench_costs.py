"""The speedup model's step costs (specsplit/bench/costs.py): c is the draft's cost per drafted
token relative to a target step, for a draft model, a feature drafter (no runner of its own: its
calibration) and prompt lookup (no forward: 0)."""
from __future__ import annotations

import pytest

from specsplit.bench.costs import measure_costs
from specsplit.config import EngineConfig, SpecConfig
from specsplit.factory import build_colocated

PROMPT = list(range(5, 37))


@pytest.mark.parametrize("k_policy", ["auto", "fixed"])
@pytest.mark.parametrize("draft", ["tiny_draft_close", "tiny_head", "ngram"])
def test_draft_cost_is_measured_for_every_kind_of_draft(request, tiny_llama, draft, k_policy):
    model = draft if draft == "ngram" else str(request.getfixturevalue(draft))
    tc = EngineConfig(model=str(tiny_llama), max_model_len=128, max_num_seqs=2)
    dc = EngineConfig(model=model, max_model_len=128, max_num_seqs=2)
    colo = build_colocated(tc, dc, SpecConfig(num_speculative_tokens=2, k_policy=k_policy), show_progress=False)
    try:
        costs = measure_costs(colo, PROMPT, [1, 2])
    finally:
        colo.close()
    assert costs["target_step_ms"] > 0 and set(costs["v"]) == {1, 2} and all(v > 0 for v in costs["v"].values())
    if draft == "ngram":
        assert costs["c"] == 0.0 and "draft_step_ms" not in costs
    else:
        assert costs["c"] > 0 and costs["draft_step_ms"] > 0
        assert costs["c"] == pytest.approx(costs["draft_step_ms"] / costs["target_step_ms"])
    drafter = colo.drafter.model if hasattr(colo.drafter, "model") else colo.drafter
    if draft == "tiny_head" and k_policy == "auto":  # the head's own calibration (build_colocated ran it)
        assert costs["draft_step_ms"] == pytest.approx(1000 * drafter.step_costs.draft_s(1))
