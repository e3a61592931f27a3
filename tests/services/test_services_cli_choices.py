"""`specsplit generate --server --n N` through the real CLI (specsplit.cli.main) against one real
colocated tiny server (n-gram speculation): --json prints a list of N objects in index order, choice
i of a seeded request is seed + i's own one-choice completion; text mode prints each choice whole
under its index; --n outside [1, 16] is a one-line error (exit 2). Without --server the local mode
runs the N choices itself and prints the same: the server's choices of a seed, the same text blocks."""
from __future__ import annotations

import json

import pytest

from specsplit.cli import main
from tests.services.procs import start_colocated

PROMPT = "5,9,13,21,34"


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_llama):
    stack = start_colocated(tmp_path_factory.mktemp("cli-choices-logs"), tiny_llama, "ngram", max_num_seqs=4)
    try:
        yield stack.ready().gateway
    finally:
        stack.stop()


def _run(capsys, argv) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def _generate(server, *flags) -> list[str]:
    return ["generate", "--server", server, "--prompt-token-ids", PROMPT, "--max-tokens", "8", "--ignore-eos", *flags]


def test_json_is_a_list_of_choices_each_its_seed_s_own(server, capsys):
    code, out, _ = _run(capsys, _generate(server, "--temperature", "1", "--seed", "40", "--n", "3", "--json"))
    assert code == 0
    choices = json.loads(out.strip().splitlines()[-1])
    assert [c["index"] for c in choices] == [0, 1, 2]
    for i, c in enumerate(choices):
        assert c["finish_reason"] == "length" and len(c["token_ids"]) == 8 and c["usage"]["completion_tokens"] == 8
        code, out, _ = _run(capsys, _generate(server, "--temperature", "1", "--seed", str(40 + i), "--json"))
        alone = json.loads(out.strip().splitlines()[-1])
        assert code == 0 and isinstance(alone, dict)  # one choice: the one object, as before
        assert alone["token_ids"] == c["token_ids"] and alone["text"] == c["text"]


def test_text_mode_prints_each_choice_under_its_index(server, capsys):
    code, out, err = _run(capsys, _generate(server, "--temperature", "0", "--n", "2", "--json"))
    greedy = [c["text"] for c in json.loads(out.strip().splitlines()[-1])]
    code, out, err = _run(capsys, _generate(server, "--temperature", "0", "--n", "2"))
    assert code == 0 and "[2 choices, 16 tokens" in err
    for i in range(2):
        assert f"--- choice {i} (finish=length) ---\n{greedy[i]}\n" in out
    assert out.count("--- choice ") == 2


@pytest.mark.parametrize("flags, words", [
    (["--n", "0"], "--n must be in [1, 16], got 0"),
    (["--n", "17"], "--n must be in [1, 16], got 17"),
])
def test_bad_n_is_a_one_line_error(server, capsys, flags, words):
    code, out, err = _run(capsys, _generate(server, *flags))
    assert code == 2 and err.strip() == f"specsplit generate: {words}" and out == ""


def test_local_n_is_the_server_s_n(server, capsys, tiny_llama):
    """Without --server: the same N choices (choice i of a seed draws with seed + i, one rule:
    specsplit.request.choice_seed), printed the same way."""
    local = ["generate", "--target", str(tiny_llama), "--draft", "ngram", "--prompt-token-ids", PROMPT,
             "--max-tokens", "8", "--ignore-eos", "--max-model-len", "256", "--threads", "1"]
    for flags in (["--temperature", "1", "--seed", "40", "--n", "3", "--json"], ["--temperature", "0", "--n", "2", "--json"]):
        code, out, _ = _run(capsys, _generate(server, *flags))
        served = json.loads(out.strip().splitlines()[-1])
        code, out, err = _run(capsys, local + flags)
        assert code == 0, err
        mine = json.loads(out.strip().splitlines()[-1])
        assert [(c["index"], c["token_ids"], c["text"], c["finish_reason"]) for c in mine] == \
            [(c["index"], c["token_ids"], c["text"], c["finish_reason"]) for c in served]
    assert mine[0]["token_ids"] == mine[1]["token_ids"]  # greedy: two equal choices
    code, out, err = _run(capsys, local + ["--temperature", "0", "--n", "2"])
    assert code == 0 and "[2 choices, 16 tokens" in err
    assert out == "".join(f"--- choice {i} (finish=length) ---\n{mine[i]['text']}\n" for i in range(2))
