"""specsplit.sampling.penalties against a plain per-token reference (OpenAI's presence / frequency
penalties, transformers' repetition penalty, logit_bias), the bounds of each new field, and the
grammar compiler's cache, time bound and errors (specsplit.sampling.grammar)."""
from __future__ import annotations

import json

import pytest
import torch

from specsplit.sampling.grammar import GrammarCompiler, GrammarError
from specsplit.sampling.params import Grammar, SamplingParams
from specsplit.sampling.penalties import penalize
from tests.helpers.tiny_models import VOCAB_WORDS, write_tokenizer


def _reference(logits, params, prompt, generated, drafts):
    out = logits.clone().double()
    for j in range(out.shape[0]):
        gen = list(generated) + list(drafts[:j])
        for v in range(out.shape[1]):
            x = float(out[j, v])
            if v in prompt or v in gen:
                r = params.repetition_penalty
                x = x / r if x > 0 else x * r
            c = gen.count(v)
            x -= params.frequency_penalty * c + params.presence_penalty * (c > 0)
            x += dict(params.logit_bias).get(v, 0.0)
            if len(gen) < params.min_tokens and v in params.min_tokens_stop_ids:
                x = float("-inf")
            out[j, v] = x
    return out.float()


@pytest.mark.parametrize("params", [
    SamplingParams(presence_penalty=0.7),
    SamplingParams(frequency_penalty=-1.3),
    SamplingParams(repetition_penalty=1.7),
    SamplingParams(repetition_penalty=0.6, presence_penalty=-0.4, frequency_penalty=2.0, logit_bias=((3, 5.5), (9, -100.0))),
    SamplingParams(logit_bias=((0, 1.0),)),
    # generated has 4 tokens: rows 0 and 1 (4 and 5 before them) come before min_tokens 6, rows 2 and 3 not
    SamplingParams(min_tokens=6, min_tokens_stop_ids=(2, 7)),
    SamplingParams(min_tokens=6, min_tokens_stop_ids=(2,), frequency_penalty=0.5, logit_bias=((2, 3.0),)),
    SamplingParams(min_tokens=4, min_tokens_stop_ids=(2, 7)),  # reached: nothing held back
])
def test_penalize_matches_the_per_token_rules(params):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 12, generator=g) * 3
    prompt, generated, drafts = [1, 2, 2], [3, 4, 3, 11], [4, 5, 4]
    got = penalize(logits, params, prompt, generated, drafts)
    torch.testing.assert_close(got, _reference(logits, params, prompt, generated, drafts), rtol=1e-6, atol=1e-5)
    held = max(0, min(4, params.min_tokens - len(generated)))
    assert int(torch.isinf(got).sum()) == held * len(params.min_tokens_stop_ids)
    assert torch.equal(logits, logits.clone())  # the input is not changed


def test_no_penalties_is_the_logits():
    logits = torch.randn(3, 7)
    assert torch.equal(penalize(logits, SamplingParams(), [1], [2, 3], [4, 5]), logits)


@pytest.mark.parametrize("kw, needle", [
    (dict(presence_penalty=2.01), "presence_penalty must be in [-2, 2]"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty must be in [-2, 2]"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be in [0.01, 10]"),
    (dict(repetition_penalty=10.5), "repetition_penalty must be in [0.01, 10]"),
    (dict(logit_bias=((1, 100.5),)), "logit_bias of token 1 must be in [-100, 100]"),
    (dict(logit_bias=((-1, 1.0),)), "outside the vocabulary"),
    (dict(logit_bias=((1, 1.0), (1, 2.0))), "names token id 1 twice"),
    (dict(logit_bias=tuple((i, 1.0) for i in range(301))), "at most 300 token ids"),
    (dict(grammar=Grammar("xml", "<a/>")), "grammar kind must be one of"),
    (dict(grammar=Grammar("regex", "")), "the regex grammar is empty"),
    (dict(grammar=Grammar("json_schema", "x" * 70000)), "at most 65536 are allowed"),
    (dict(grammar=Grammar("json_object", "{}")), "json_object grammar takes no text"),
    (dict(min_tokens=-1), "min_tokens must be >= 0"),
    (dict(min_p=1.01), "min_p must be in [0, 1]"),
    (dict(min_p=float("nan")), "min_p must be in [0, 1]"),
    (dict(min_tokens=3, min_tokens_stop_ids=(2, 256)), "min_tokens stop ids [256] are outside the vocabulary"),
    (dict(min_tokens=3, min_tokens_stop_ids=tuple(range(129))), "at most 128 stop ids"),
])
def test_bounds_are_refused_with_the_rule(kw, needle):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kw).validate(vocab_size=256)
    assert needle in str(err.value)


def test_bounds_at_their_limits_are_accepted():
    SamplingParams(presence_penalty=-2, frequency_penalty=2, repetition_penalty=0.01,
                   logit_bias=tuple((i, 100.0 if i % 2 else -100.0) for i in range(300))).validate(vocab_size=300)


@pytest.fixture(scope="module")
def compiler(tmp_path_factory):
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("tok")
    write_tokenizer(d)
    return GrammarCompiler(AutoTokenizer.from_pretrained(d), len(VOCAB_WORDS), (2,))


def test_compiles_are_cached_by_text(compiler):
    g = Grammar("regex", "(w1|w2)+")
    before = compiler.compiles
    a = compiler.compile(g)
    b = compiler.compile(Grammar("regex", "(w1|w2)+"))
    assert a is b and compiler.compiles == before + 1
    compiler.compile(Grammar("regex", "(w1|w3)+"))
    assert compiler.compiles == before + 2


@pytest.mark.parametrize("g, needle", [
    (Grammar("regex", "(w1"), "the regex grammar does not compile"),
    (Grammar("ebnf", "root ::= undefined_rule"), "the ebnf grammar does not compile"),
    (Grammar("json_schema", "{not json"), "the JSON schema is not valid JSON"),
    (Grammar("json_schema", "[1, 2]"), "must be a JSON object"),
])
def test_bad_grammars_are_grammar_errors(compiler, g, needle):
    with pytest.raises(GrammarError) as err:
        compiler.compile(g)
    assert needle in str(err.value)


def test_a_slow_compile_is_refused_within_the_bound(compiler):
    # A schema with many properties takes far longer than a microsecond to compile.
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": "w[0-9]+"} for i in range(200)}}
    with pytest.raises(GrammarError) as err:
        compiler.compile(Grammar("json_schema", json.dumps(schema)), timeout_s=1e-6)
    assert "did not compile within" in str(err.value)


def test_the_cache_is_bounded_in_count_and_bytes(tmp_path):
    from transformers import AutoTokenizer

    write_tokenizer(tmp_path)
    small = GrammarCompiler(AutoTokenizer.from_pretrained(tmp_path), len(VOCAB_WORDS), (2,), max_cached=2)
    for i in range(4):
        small.compile(Grammar("regex", f"w{i}+"))
    assert len(small._cache) == 2 and list(small._cache) == [("regex", "w2+"), ("regex", "w3+")]
    tight = GrammarCompiler(AutoTokenizer.from_pretrained(tmp_path), len(VOCAB_WORDS), (2,), max_cached_bytes=1)
    for i in range(3):
        tight.compile(Grammar("regex", f"w{i}+"))
    assert list(tight._cache) == [("regex", "w2+")]  # the newest stays
    assert tight.compile(Grammar("regex", "w2+")) is tight._cache[("regex", "w2+")]
