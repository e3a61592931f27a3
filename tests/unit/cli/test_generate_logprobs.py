"""`specsplit generate --server ... --logprobs N`: the request carries the optional field only when
asked, and --json prints the streamed logprobs in the local mode's shape."""
from __future__ import annotations

from argparse import Namespace

from specsplit.gateway.generate_client import collect, logprobs_json, request_from_args
from specsplit.v1 import common_pb2, gateway_pb2
from specsplit.request import TokenLogprob


def _args(**kw):
    base = dict(max_tokens=4, temperature=0.0, top_p=1.0, top_k=0, ignore_eos=False, prompt="hi",
                prompt_token_ids=None, seed=None, num_speculative_tokens=None, logprobs=None)
    return Namespace(**{**base, **kw})


def test_logprobs_field_set_only_when_asked():
    assert not request_from_args(_args()).HasField("logprobs")
    for n in (0, 3):
        req = request_from_args(_args(logprobs=n))
        assert req.HasField("logprobs") and req.logprobs == n


def test_collect_prints_the_local_shape():
    lps = [TokenLogprob(5, -0.5, ((5, -0.5), (6, -1.5))), TokenLogprob(7, -0.25, ((7, -0.25), (1, -2.0)))]
    msgs = [
        gateway_pb2.GenerateResponse(token_ids=[5], text="a", logprobs=[common_pb2.TokenLogprob(
            token_id=5, logprob=-0.5, top=[common_pb2.TopLogprob(token_id=5, logprob=-0.5),
                                           common_pb2.TopLogprob(token_id=6, logprob=-1.5)])]),
        gateway_pb2.GenerateResponse(token_ids=[7], text="b", finish_reason="length", logprobs=[common_pb2.TokenLogprob(
            token_id=7, logprob=-0.25, top=[common_pb2.TopLogprob(token_id=7, logprob=-0.25),
                                            common_pb2.TopLogprob(token_id=1, logprob=-2.0)])]),
    ]
    out = collect(msgs)
    assert out["token_ids"] == [5, 7] and out["logprobs"] == logprobs_json(lps)
    assert out["logprobs"][0] == {"token_id": 5, "logprob": -0.5,
                                  "top": [{"token_id": 5, "logprob": -0.5}, {"token_id": 6, "logprob": -1.5}]}
    assert "logprobs" not in collect([gateway_pb2.GenerateResponse(token_ids=[5], finish_reason="length")])


def test_logprobs_without_json_are_refused_before_any_model_loads(capsys):
    """Text mode prints no log-probabilities: --logprobs alone would be asked for and dropped."""
    from specsplit.cli import main

    argv = ["generate", "--prompt-token-ids", "5,6", "--draft", "none", "--check", "--logprobs", "2"]
    assert main(argv) == 2
    assert "--logprobs are printed in the JSON output: add --json" in capsys.readouterr().err
    assert main([*argv, "--json"]) == 0
