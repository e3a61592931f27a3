"""On the real SmolLM2-135M: structured output and penalties are lossless under speculation, and
the OpenAI HTTP API returns schema-valid JSON.

  * greedy, colocated: target-only == speculative (the n-gram proposer, and the target itself as an
    unconstrained draft whose drafts leave the grammar and are cut) with a JSON schema, and with
    presence / frequency / repetition penalties and logit_bias; a difference only at a certified
    near-tie of the constrained target's logits (tests/helpers/greedy.py);
  * a real `specsplit serve --http-port`: chat completions with response_format json_schema and
    json_object parse as JSON and validate against the schema; a schema that does not compile is a
    400 naming the problem.
"""
from __future__ import annotations

import json

import pytest

from specsplit.config import EngineConfig, SpecConfig
from specsplit.factory import build_colocated
from specsplit.request import GenerationRequest
from specsplit.sampling.params import Grammar, SamplingParams
from specsplit.scheduler import Scheduler
from tests.helpers.greedy import assert_greedy_equal_or_tie, native_next_logits
from tests.helpers.structured import constrained_next_logits, serve_smollm_http
from tests.services.procs import HOST, http_call

pytestmark = [pytest.mark.smollm, pytest.mark.slow]

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"type": "string"}},
          "required": ["name", "age", "city"]}
PROMPTS = ["Describe a person named Alice who is 30 and lives in Paris, as JSON.",
           "Give me a JSON record for Bob, 42 years old, from Berlin."]
NEW = 48
CASES = {
    "json_schema": SamplingParams(grammar=Grammar("json_schema", json.dumps(SCHEMA))),
    "penalties": SamplingParams(presence_penalty=0.6, frequency_penalty=0.4, repetition_penalty=1.2,
                                logit_bias=((28, 2.0), (330, -100.0))),
}
ENGINE = dict(max_model_len=256, max_prefill_tokens=128, max_num_seqs=2)


def _chat_ids(tokenizer, prompt: str) -> tuple[int, ...]:
    return tuple(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                               tokenize=True, return_dict=False))


@pytest.fixture(scope="module")
def runs():
    """Outputs per (case, drafter), the tokenizer, the grammar compiler and the reference logits."""
    out = {}
    for draft, k in ((None, 0), ("ngram", 4), ("smollm2-135m", 4)):
        dc = None if draft is None else EngineConfig(model=draft, **ENGINE)
        colo = build_colocated(EngineConfig(model="smollm2-135m", **ENGINE), dc, SpecConfig(num_speculative_tokens=k),
                               show_progress=False)
        for case, params in CASES.items():
            reqs = [GenerationRequest(f"r{i}", _chat_ids(colo.tokenizer, p), NEW, params=params)
                    for i, p in enumerate(PROMPTS)]
            states = Scheduler(colo.decoder, colo.eos_token_ids, 2).run(reqs)
            out[(case, draft)] = ([r.prompt_token_ids for r in reqs], [s.output for s in states],
                                  sum(s.proposed for s in states))
        if draft is None:
            out["tokenizer"], out["compiler"] = colo.tokenizer, colo.target.grammars
            out["next_logits"] = native_next_logits(colo.target_model.model)
        colo.close()
    return out


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("draft", ["ngram", "smollm2-135m"])
def test_speculative_equals_target_only(runs, case, draft):
    prompts, ref, _ = runs[(case, None)]
    _, out, proposed = runs[(case, draft)]
    assert proposed > 0
    for p, r, o in zip(prompts, ref, out):
        assert_greedy_equal_or_tie(r, constrained_next_logits(runs["next_logits"], CASES[case], len(p), runs["compiler"]), o,
                                   prompt=p)


def test_json_schema_output_is_valid_json(runs):
    jsonschema = pytest.importorskip("jsonschema")
    for draft in (None, "ngram", "smollm2-135m"):
        for o in runs[("json_schema", draft)][1]:
            text = runs["tokenizer"].decode(o, skip_special_tokens=True)
            jsonschema.validate(json.loads(text), SCHEMA)


@pytest.fixture(scope="module")
def http_server(tmp_path_factory):
    yield from serve_smollm_http(tmp_path_factory.mktemp("structured-http"), 256)


def _post(srv, body: dict) -> tuple[int, dict]:
    status, raw = http_call(srv.http_port, "/v1/chat/completions", body, timeout=120, host=HOST)
    return status, json.loads(raw)


def test_http_response_format_gives_schema_valid_json(http_server):
    jsonschema = pytest.importorskip("jsonschema")
    messages = [{"role": "user", "content": PROMPTS[0]}]
    status, body = _post(http_server, {"model": "smollm2-135m", "messages": messages, "max_tokens": 64, "temperature": 0,
                                       "response_format": {"type": "json_schema",
                                                           "json_schema": {"name": "person", "schema": SCHEMA}}})
    assert status == 200, body
    content = body["choices"][0]["message"]["content"]
    assert body["choices"][0]["finish_reason"] == "stop", content
    jsonschema.validate(json.loads(content), SCHEMA)
    status, body = _post(http_server, {"model": "smollm2-135m", "messages": messages, "max_tokens": 64,
                                       "temperature": 0.8, "seed": 3, "response_format": {"type": "json_object"}})
    assert status == 200, body
    if body["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(body["choices"][0]["message"]["content"]), dict)
    status, body = _post(http_server, {"model": "smollm2-135m", "messages": messages, "max_tokens": 8,
                                       "response_format": {"type": "json_schema", "json_schema": {
                                           "name": "bad", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}})
    assert status == 400 and "does not compile" in body["error"]["message"], body
    assert body["error"]["param"] == "response_format", body  # the field to fix
