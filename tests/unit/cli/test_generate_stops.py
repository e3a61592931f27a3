"""`specsplit generate` stop flags (--stop, --include-stop-str-in-output, --stop-token-ids, --min-tokens): the same request locally
as the gateway builds from the --server request they become, and refused with the flag's name
before any model loads."""
from __future__ import annotations

import pytest

from specsplit.cli import build_parser, main
from specsplit.cli.generate import _request
from specsplit.gateway.generate_client import request_from_args
from specsplit.gateway.service import build_request

FLAGS = ["--stop", "w7", "--stop", "w8 w9", "--include-stop-str-in-output", "--stop-token-ids", "11, 12",
         "--min-tokens", "3", "--max-tokens", "6"]


def test_flags_are_the_same_request_locally_and_over_grpc():
    args = build_parser().parse_args(["generate", "--prompt-token-ids", "5,6", "--server", "127.0.0.1:1", *FLAGS])
    local = _request(args, (5, 6))
    assert (local.stop, local.stop_token_ids, local.params.min_tokens) == (("w7", "w8 w9"), (11, 12), 3)
    assert local.include_stop_str_in_output
    remote = build_request(request_from_args(args), [5, 6])
    assert (remote.stop, remote.stop_token_ids, remote.params, remote.max_tokens, remote.include_stop_str_in_output) == (
        local.stop, local.stop_token_ids, local.params, local.max_tokens, True)


@pytest.mark.parametrize("flags, message", [
    (["--min-tokens", "7", "--max-tokens", "6"], "--min-tokens (7) must be <= max_tokens (6)"),
    (["--stop-token-ids", "1,x"], "--stop-token-ids must be comma-separated integers"),
    (["--stop-token-ids", ",".join(map(str, range(65)))], "--stop-token-ids takes at most 64 token ids"),
    (["--stop", ""], "--stop takes at most 16 non-empty strings"),
    (["--json-object", "--min-tokens", "2"], "--min-tokens cannot be combined with a grammar"),
])
def test_bad_stop_flags_are_refused_naming_the_flag(flags, message, capsys):
    assert main(["generate", "--prompt-token-ids", "5,6", "--draft", "none", "--check", *flags]) == 2
    assert message in capsys.readouterr().err


def test_good_stop_flags_pass_the_check(capsys):
    assert main(["generate", "--prompt-token-ids", "5,6", "--draft", "none", "--check", *FLAGS]) == 0


def test_local_text_leaves_out_the_token_that_ends_it(tiny_llama, capsys):
    """Locally, as the gateway: a stop token ends the output and is in its tokens, its text only
    with --include-stop-str-in-output (the local mode printed every token's text, EOS's
    <|im_end|> included, where --server did not)."""
    import json

    from specsplit.models.loader import load_tokenizer

    base = ["generate", "--target", str(tiny_llama), "--draft", "none", "--prompt-token-ids", "5,9,13",
            "--max-tokens", "8", "--max-model-len", "256", "--threads", "1"]

    def run(*flags, as_json=True):
        capsys.readouterr()
        assert main([*base, *flags, *(["--json"] if as_json else [])]) == 0
        out = capsys.readouterr().out
        return json.loads(out.strip().splitlines()[-1]) if as_json else out

    ids = run("--ignore-eos")["token_ids"]
    j = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i])  # a token that first comes at j
    decode = load_tokenizer(tiny_llama).decode
    cut = run("--stop-token-ids", str(ids[j]))
    assert cut["token_ids"] == ids[:j + 1] and cut["finish_reason"] == "stop"
    assert cut["text"] == decode(ids[:j]) != decode(ids[:j + 1])
    assert run("--stop-token-ids", str(ids[j]), "--include-stop-str-in-output")["text"] == decode(ids[:j + 1])
    assert run("--stop-token-ids", str(ids[j]), as_json=False) == decode(ids[:j])  # streamed text
