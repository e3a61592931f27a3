"""The speculation defaults a server picks when no flag says otherwise (specsplit/cli/common.py)."""
from __future__ import annotations

import argparse

import pytest

from specsplit.cli.common import (add_engine_flags, add_spec_flags, default_disable_by_batch_size, default_k_for,
                                  spec_config)
from specsplit.cli.up import _spec_flags


def _args(argv):
    p = argparse.ArgumentParser()
    add_engine_flags(p)
    add_spec_flags(p)
    return p.parse_args(argv)


@pytest.mark.parametrize("draft,k", [(None, 0), ("ngram", 4), ("smollm2-135m-draft", 2), ("smollm2-135m-draft+ngram", 3)])
def test_default_k(draft, k):
    assert default_k_for(draft) == k
    assert spec_config(_args([]), draft).num_speculative_tokens == k


def test_k_policy_is_auto_and_needs_no_threshold():
    cfg = spec_config(_args([]), "ngram")
    assert cfg.k_policy == "auto" and cfg.disable_by_batch_size == 0  # the policy turns it off itself
    assert spec_config(_args(["--k-policy", "fixed"]), "ngram").k_policy == "fixed"
    assert default_disable_by_batch_size("cpu") == 0


def test_disable_threshold_follows_the_target_device_unless_given():
    assert default_disable_by_batch_size("cpu", "fixed") == 1
    assert default_disable_by_batch_size("cuda:0", "fixed") == 0
    assert spec_config(_args(["--k-policy", "fixed"]), "ngram").disable_by_batch_size == 1  # --device defaults to cpu
    assert spec_config(_args(["--k-policy", "fixed", "--device", "cuda:1"]), "ngram").disable_by_batch_size == 0
    assert spec_config(_args(["--disable-by-batch-size", "6"]), "ngram").disable_by_batch_size == 6
    assert spec_config(_args(["--disable-by-batch-size", "0"]), "ngram").disable_by_batch_size == 0


def test_up_leaves_the_default_to_the_gateway_and_passes_an_explicit_value():
    args = _args(["--draft-model-tokens", "2"])
    args.draft = "smollm2-135m-draft+ngram"
    flags = _spec_flags(args)
    assert "--disable-by-batch-size" not in flags
    assert flags[flags.index("--num-speculative-tokens") + 1] == "3"
    assert flags[flags.index("--draft-model-tokens") + 1] == "2"
    args.disable_by_batch_size = 0
    assert _spec_flags(args)[-2:] == ["--disable-by-batch-size", "0"]


def test_tree_nodes_turn_the_split_gateways_pre_drafting_off_unless_asked():
    assert spec_config(_args([]), "ngram").tree_nodes == 0
    assert spec_config(_args([]), "ngram", split=True).async_draft  # the split default: pre-drafting
    trees = spec_config(_args(["--tree-nodes", "2"]), "ngram", split=True)
    assert trees.tree_nodes == 2 and not trees.async_draft  # trees need lockstep
    assert spec_config(_args(["--tree-nodes", "2", "--async-draft"]), "ngram", split=True).async_draft
    args = _args(["--tree-nodes", "3"])
    args.draft = "ngram"
    flags = _spec_flags(args)
    assert flags[flags.index("--tree-nodes") + 1] == "3"  # `specsplit up` passes it to its gateway
