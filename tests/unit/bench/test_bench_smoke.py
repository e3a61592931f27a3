"""`specsplit bench --quick` on a tiny random pair: every field present, acceptance consistent; the
split arm (`specsplit up` on loopback, stopped by the bench itself) gives the colocated arm's tokens;
its model arguments are checked before anything loads."""
from __future__ import annotations

import json

import pytest

from specsplit.cli import main

FIELDS = {"arm", "tokens_per_s", "ttft_ms", "tpot_ms", "acceptance_rate", "mean_accepted_length",
          "per_position_acceptance", "proposed_draft_tokens", "accepted_draft_tokens", "generated_tokens"}


def test_bench_quick_json(tmp_path, tiny_llama, tiny_draft_close):
    out = tmp_path / "bench"
    rc = main(["bench", "all", "--quick", "--target", str(tiny_llama), "--draft", str(tiny_draft_close),
               "--prompt-token-ids", "5,6,7,8,5,6,7,8,9", "--max-model-len", "128", "--new-tokens", "12",
               "--threads", "1", "--no-progress", "--tree-nodes", "2", "--out", str(out)])
    assert rc == 0
    report = json.loads((out / "bench.json").read_text())
    assert (out / "bench.png").stat().st_size > 0
    arms = report["arms"]
    names = [a["arm"] for a in arms]
    for needle in ("native target-only", "transformers generate", "HF assisted constant", "HF assisted heuristic",
                   "specsplit colocated ngram K=2", "concurrency 4 spec", "specsplit split grpc",
                   f"specsplit colocated {tiny_draft_close}+ngram K=2", f"specsplit colocated {tiny_draft_close} K=2",
                   "K=2 tree<=2", "policy K<=3 tree<=2"):
        assert any(needle in n for n in names), (needle, names)
    for a in arms:
        assert FIELDS <= set(a), (a["arm"], FIELDS - set(a))
        assert a["tokens_per_s"] > 0 and a["generated_tokens"] > 0
        if a["proposed_draft_tokens"]:
            assert a["acceptance_rate"] == a["accepted_draft_tokens"] / a["proposed_draft_tokens"]
            assert 0 <= a["acceptance_rate"] <= 1
            assert len(a["per_position_acceptance"]) >= 1
            assert all(0 <= x <= 1 for x in a["per_position_acceptance"])
        elif a["arm"].startswith(("specsplit colocated", "specsplit split")) and a.get("role") != "policy":
            # (the K policy may rightly draft nothing: a tiny draft costs what the tiny target does)
            raise AssertionError(f"{a['arm']} proposed nothing")
    # Batch-1 arms run interleaved; greedy spec output is the target's in every arm (fp32), and the
    # native target-only output is transformers' (the bench checks it on every run).
    assert all(a["interleaved"] >= 2 for a in arms if a["suite"] in ("target", "spec") and a.get("mode") is None)
    assert all(a["same_tokens_as_target_only"] is True for a in arms
               if a["arm"].startswith("specsplit colocated") and a.get("mode") is None)
    assert all(a["same_tokens_as_hf"] is True for a in arms if a["suite"] == "target" and "native" in a["arm"])
    spec = [a for a in arms if a["arm"].startswith("specsplit colocated") and a.get("draft") != "ngram"
            and a.get("role") != "policy" and not a.get("tree_nodes")]
    assert spec and all("speedup_vs_target_only" in a and "predicted_speedup" in a for a in spec)
    # the K policy arm: calibrated at start-up, the K it chose per step reported
    # (--tree-nodes: the same with trees the calibrated verify cost sizes)
    policies = [a for a in arms if a.get("role") == "policy"]
    assert sorted(a["arm"].endswith("tree<=2") for a in policies) == [False, True]
    for policy in policies:
        assert policy["calibration"] and "B=1" in policy["calibration"]
        assert sum(policy["k_chosen"].values()) > 0 and policy["same_tokens_as_target_only"] is True
    trees = [a for a in arms if a.get("tree_nodes")]
    assert trees and all(a["same_tokens_as_target_only"] is True for a in trees)
    sweep = [a for a in arms if a["suite"] == "concurrency" and a["speculation"]]
    assert sweep and all("k_chosen" in a and "speedup_vs_target_only" in a for a in sweep)
    assert {"c", "v", "target_step_ms"} <= set(report["costs"])

    # The split arm runs the served draft (MODEL+ngram unless --no-hybrid): K = the quick ks' first
    # (2), same tokens as the colocated arm of that draft at that K.
    (split,) = [a for a in arms if a["arm"].startswith("specsplit split grpc")]
    (colo,) = [a for a in arms if a.get("mode") == "colocated-paired"]  # interleaved run by run with split
    assert colo["arm"] == f"specsplit colocated {tiny_draft_close}+ngram K=2 (paired with split)"
    assert colo["draft"] == split["draft"] and colo["k"] == 2 and colo["interleaved_with_split"] is True
    assert split["arm"] == f"specsplit split grpc {tiny_draft_close}+ngram K=2" and split["k"] == 2
    assert split["draft"] == f"{tiny_draft_close}+ngram" and report["settings"]["split_ks"] == [2]
    assert split["same_tokens_as_colocated"] is True
    # its stack computes every repeat's prompt, as the colocated arms do (no prefix cache): with
    # one, the repeats' prompts came from it and the split arm's TTFT and tok/s beat colocated's
    assert split["prefix_caching"] is False
    assert split["generated_tokens"] == colo["generated_tokens"] == 2 * 12
    assert split["ratio_vs_colocated"] == split["tokens_per_s"] / colo["tokens_per_s"]
    assert split["speedup_vs_target_only"] > 0
    # The split gateway pre-drafts (its default) and the colocated arm runs lockstep: on a branch
    # the hybrid's model drafts all K (off the critical path), in lockstep one token, so the draft
    # counts may differ; the tokens may not (above).
    assert split["proposed_draft_tokens"] > 0 and colo["proposed_draft_tokens"] > 0
    # The per-message draft counts give the split arm its speculative steps: per-position acceptance
    # and mean accepted length are reported (checked in [0, 1] with the other arms above).
    assert split["per_position_acceptance"] and split["mean_accepted_length"] is not None
    # One response per decode step, each step's tokens = its accepted drafts + 1.
    assert split["generated_tokens"] == split["accepted_draft_tokens"] + split["decode_steps"]


@pytest.mark.parametrize("flags, message", [
    (["--draft", "none"], "--draft none: the spec arms need a draft"),
    (["--draft", "nope"], "--draft: unknown model 'nope'"),
    (["--also-draft", "nope+ngram"], "--also-draft: unknown model 'nope'"),
    (["--target", "nope"], "--target: unknown model 'nope'"),
])
def test_model_arguments_are_checked_before_anything_loads(flags, message, capsys):
    """`--check` passed these and a run failed on them (--draft none once the target arms had run)."""
    assert main(["bench", "spec", *flags, "--check"]) == 2
    assert message in capsys.readouterr().err
    assert main(["bench", "spec", "--draft", "smollm2-135m-eagle3+ngram", "--also-draft", "ngram", "--check"]) == 0


def _ticks(*flags: str) -> int:
    from specsplit.bench.suite import Bench
    from specsplit.cli import build_parser

    return Bench(build_parser().parse_args(["bench", "spec", "--quick", "--no-split", *flags])).total_ticks()


def test_a_lookup_draft_has_no_transformers_arms_in_the_progress_count():
    """`--draft suffix` is a prompt lookup as ngram is: its K arms beside ngram's, and no transformers
    arms (the spec suite runs none for a draft without a model; the count said 3)."""
    from specsplit.bench.suite import model_draft_of

    assert [model_draft_of(d) for d in (None, "ngram", "suffix", "smollm2-135m-draft")] == \
        [None, None, None, "smollm2-135m-draft"]
    per_k_arm = 2 * 2  # --quick: 2 prompts, K = 2 and 4
    assert _ticks("--draft", "suffix") == _ticks("--draft", "ngram") + per_k_arm
    assert _ticks("--draft", "suffix", "--no-hf") == _ticks("--draft", "suffix")
