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


def test_model_arguments_that_name_no_model_are_refused_before_any_model_loads(capsys, tmp_path):
    """--target, --draft and an engine's --model are resolved first (--check: the aliases; paths
    may name files on another machine): a misspelt draft was found only after the target had
    loaded. A draft may be a lookup or MODEL+lookup; a verifier's model may not be a lookup."""
    from specsplit.cli import main

    refused = {
        ("serve", "--target", "smollm2-135m", "--draft", "smollm2-135m-eagel3+ngram"): "--draft: unknown model 'smollm2-135m-eagel3'",
        ("up", "--target", "smollm2-135m", "--draft", "nope+suffix"): "--draft: unknown model 'nope'",
        ("generate", "--target", "smollm2-135m", "--draft", "nope", "hi"): "--draft: unknown model 'nope'",
        ("drafter", "--model", "nope+ngram"): "--model: unknown model 'nope'",
        ("verifier", "--model", "ngram"): "--model: unknown model 'ngram'",
    }
    for argv, message in refused.items():
        assert main([*argv, "--check"]) == 2, argv
        assert message in capsys.readouterr().err, argv
    for argv in (("serve", "--target", "smollm2-135m", "--draft", "smollm2-135m-eagle3+ngram"),
                 ("serve", "--target", "smollm2-135m", "--draft", "none"), ("serve", "--target", "smollm2-135m"),
                 ("up", "--target", "smollm2-135m", "--draft", "smollm2-135m-draft+suffix"),
                 ("drafter", "--model", "suffix"), ("drafter", "--model", "ngram"),
                 ("verifier", "--model", "smollm2-135m"), ("generate", "--server", "127.0.0.1:1", "hi")):
        assert main([*argv, "--check"]) == 0, argv
    # a path is checked when the command runs, before any model loads
    missing = str(tmp_path / "missing.gguf")
    assert main(["serve", "--target", missing, "--check"]) == 0
    assert main(["serve", "--target", missing, "--port", "0"]) == 2
    assert f"--target: unknown model {missing!r}" in capsys.readouterr().err
