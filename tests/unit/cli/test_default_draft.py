"""A target with a shipped draft speculates by default; --draft none is target-only."""
from __future__ import annotations

import pytest

from specsplit.cli import main
from specsplit.defaults import DEFAULT_DRAFTS, bench_draft, bench_hybrid, default_k_for, resolve_draft
from specsplit.models.registry import check_model_argument


def test_resolve_draft():
    assert resolve_draft("smollm2-135m", None) == DEFAULT_DRAFTS["smollm2-135m"] == "smollm2-135m-eagle3+ngram"
    assert resolve_draft("smollm2-135m", "none") is None and resolve_draft("smollm2-135m", "None") is None
    assert resolve_draft("smollm2-135m", "ngram") == "ngram"
    assert resolve_draft("/some/hf/dir", None) is None  # no shipped draft: target-only
    assert resolve_draft("smollm2-135m", None, tensor_parallel_size=2) == "smollm2-135m-draft+ngram"
    assert default_k_for("smollm2-135m-eagle3+ngram") == default_k_for("smollm2-135m-eagle3") == 3


@pytest.mark.parametrize("cmd", ["generate", "serve", "profile"])
def test_check_accepts_no_draft_and_none(cmd, capsys):
    extra = ["hi"] if cmd == "generate" else []
    assert main([cmd, "--target", "smollm2-135m", "--check", *extra]) == 0
    assert main([cmd, "--target", "smollm2-135m", "--draft", "none", "--check", *extra]) == 0


def test_up_needs_a_draft_when_the_target_has_no_default(capsys):
    assert main(["up", "--target", "smollm2-135m", "--check"]) == 0  # the default draft
    assert main(["up", "--target", "/no/such/dir", "--check"]) == 2
    assert "has no default draft" in capsys.readouterr().err


def test_bench_measures_the_served_default_draft():
    """`specsplit bench` without --draft measures the target's default draft: its model part, to
    which the bench adds the +ngram arms (its policy arm is then the served default)."""
    assert bench_draft("smollm2-135m") == "smollm2-135m-eagle3"
    assert f"{bench_draft('smollm2-135m')}+ngram" == resolve_draft("smollm2-135m", None)
    assert bench_draft("/some/hf/dir") == "ngram"  # no shipped draft: prompt lookup


@pytest.mark.parametrize("draft, hybrid", [
    ("smollm2-135m-eagle3", "smollm2-135m-eagle3+ngram"),
    ("smollm2-135m-draft", "smollm2-135m-draft+ngram"),
    # a served --draft that names its lookup already: measured as it is (was MODEL+ngram+ngram,
    # which `bench async` handed to `specsplit up` after loading its colocated engines)
    ("smollm2-135m-eagle3+ngram", "smollm2-135m-eagle3+ngram"),
    ("smollm2-135m-eagle3+suffix", "smollm2-135m-eagle3+suffix"),
    ("ngram", None), ("suffix", None), (None, None),
])
def test_bench_hybrid_arm_is_a_draft_the_servers_take(draft, hybrid):
    assert bench_hybrid(draft) == hybrid
    if hybrid is not None:
        check_model_argument(hybrid, draft=True)  # raises for a name `specsplit up --draft` refuses
