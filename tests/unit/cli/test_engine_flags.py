"""specsplit/cli/common.py validate_engine: the engine flags every serving command shares, checked
before any model loads."""
from __future__ import annotations


def test_num_blocks_below_one_sequence_is_refused_before_any_model_loads(capsys):
    from specsplit.cli import main

    for argv in (["up", "--target", "smollm2-135m", "--draft", "ngram"], ["serve", "--target", "smollm2-135m"],
                 ["verifier", "--model", "smollm2-135m"]):
        assert main([*argv, "--num-blocks", "24", "--max-model-len", "512", "--check"]) != 0
        assert "--num-blocks 24 x --block-size 16 = 384 tokens" in capsys.readouterr().err
    # a lone drafter may have no paged cache (prompt lookup): --num-blocks is its own business
    assert main(["drafter", "--model", "ngram", "--num-blocks", "2", "--max-model-len", "512", "--check"]) == 0
    assert main(["up", "--target", "smollm2-135m", "--draft", "ngram", "--num-blocks", "32", "--max-model-len", "512",
                 "--check"]) == 0
