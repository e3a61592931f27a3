"""`specsplit generate` flags for penalties and structured output: the same SamplingParams in the
local mode as the gateway builds from the --server request they become."""
from __future__ import annotations

import json

import pytest

from specsplit.cli import build_parser
from specsplit.cli.generate import params_from_args
from specsplit.gateway.generate_client import request_from_args
from specsplit.gateway.service import build_request
from specsplit.sampling.params import Grammar


def _args(*flags):
    return build_parser().parse_args(["generate", "--prompt-token-ids", "5,6", "--server", "127.0.0.1:1", *flags])


@pytest.mark.parametrize("flags, grammar", [
    ([], None),
    (["--json-object"], Grammar("json_object")),
    (["--regex", "(w1|w2)+"], Grammar("regex", "(w1|w2)+")),
    (["--json-schema", '{"type": "array"}'], Grammar("json_schema", '{"type": "array"}')),
])
def test_flags_are_the_same_params_locally_and_over_grpc(flags, grammar):
    args = _args("--presence-penalty", "0.5", "--frequency-penalty", "-1.25", "--repetition-penalty", "1.5",
                 "--temperature", "0.7", "--min-p", "0.1", *flags)
    local = params_from_args(args)
    assert (local.presence_penalty, local.frequency_penalty, local.repetition_penalty) == (0.5, -1.25, 1.5)
    assert local.min_p == 0.1
    assert local.grammar == grammar
    assert build_request(request_from_args(args), [5, 6]).params == local


def test_grammar_from_a_file(tmp_path):
    f = tmp_path / "schema.json"
    f.write_text(json.dumps({"type": "object"}))
    assert params_from_args(_args("--json-schema", f"@{f}")).grammar == Grammar("json_schema", '{"type": "object"}')


def test_formats_are_exclusive():
    with pytest.raises(SystemExit):
        _args("--json-object", "--regex", "a")
