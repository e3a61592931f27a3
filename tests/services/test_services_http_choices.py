"""`n` > 1 on the HTTP API and on gRPC (GenerateRequest.n, the same GatewayServicer.submit_choices)
through a real split stack (tiny pair, speculation on): greedy n choices are n copies of the
target's greedy completion; seeded n choices are reproducible, choice 0 is the seed's own n = 1
completion and choice i is seed + i's (chat's choices: the same code,
tests/unit/gateway/test_http_api.py; this target has no chat template); every choice's
request ends and frees its KV; n outside [1, 16] is a 400 / INVALID_ARGUMENT. On gRPC the choices'
messages interleave on one stream, each naming its choice (GenerateResponse.index).

A batch of prompts on /v1/completions (lm-eval's local-completions with --batch_size > 1): choice i
answers prompt i // n exactly as that prompt alone does, streamed or not, scored with echo or
sampled; the usage counts each prompt once; a batch with a prompt refused is a 400 that leaves
nothing running."""
from __future__ import annotations

import json

import grpc
import pytest

from specsplit.v1 import gateway_pb2, gateway_pb2_grpc
from tests.services.procs import http_call, wait_for


def _model(stack) -> str:
    return json.loads(http_call(stack.http_port, "/v1/models")[1])["data"][0]["id"]


def _post(stack, path, **body) -> dict:
    status, raw = http_call(stack.http_port, path, {"model": _model(stack), **body})
    assert status == 200, raw
    return json.loads(raw)


def _texts(out) -> list[str]:
    assert [c["index"] for c in out["choices"]] == list(range(len(out["choices"])))
    return [c["text"] if "text" in c else c["message"]["content"] for c in out["choices"]]


def _idle(stack) -> bool:
    with grpc.insecure_channel(stack.gateway) as ch:
        info = gateway_pb2_grpc.GatewayStub(ch).GetServerInfo(gateway_pb2.GetServerInfoRequest(), timeout=5)
    (verifier,) = [x for x in info.services if x.name == "verifier"]
    return info.num_running == 0 and verifier.kv.free_blocks == verifier.kv.num_blocks


def test_greedy_n_choices_are_the_target_s_completion(split_stack, prompts):
    ids = prompts[3]
    out = _post(split_stack, "/v1/completions", prompt=ids, max_tokens=12, temperature=0, n=3, ignore_eos=True,
                logprobs=0)
    texts = _texts(out)
    one = _post(split_stack, "/v1/completions", prompt=ids, max_tokens=12, temperature=0, ignore_eos=True)
    assert texts == [_texts(one)[0]] * 3
    tokens = out["choices"][0]["logprobs"]["tokens"]
    assert all(c["logprobs"]["tokens"] == tokens for c in out["choices"])
    assert out["usage"]["prompt_tokens"] == len(ids) and out["usage"]["completion_tokens"] == 36
    assert wait_for(lambda: _idle(split_stack), 10.0) is not None


def test_seeded_n_choices_are_reproducible_and_each_seed_s_own(split_stack, prompts):
    ids = prompts[7]
    body = dict(prompt=ids, max_tokens=10, temperature=1.0, seed=123, n=3, ignore_eos=True)
    first, again = _post(split_stack, "/v1/completions", **body), _post(split_stack, "/v1/completions", **body)
    assert _texts(first) == _texts(again)
    for i in range(3):
        alone = _post(split_stack, "/v1/completions", prompt=ids, max_tokens=10, temperature=1.0, seed=123 + i,
                      ignore_eos=True)
        assert _texts(first)[i] == _texts(alone)[0]
    assert len(set(_texts(first))) > 1  # different seeds: not all the same sample
    assert wait_for(lambda: _idle(split_stack), 10.0) is not None


def test_n_choices_share_the_prompt_s_kv(split_stack, expect_greedy):
    """Over gRPC with the verifier's prefix caching (its ServiceInfo says so): of 3 greedy choices
    of one 40-token prompt, the first computes it and the other two take its 2 full blocks from
    the cache (the gateway's scheduler holds them back); every choice is the target's (up to a
    certified near-tie: the reused KV was computed in another batch)."""
    from tests.services.procs import scrape

    def hits() -> tuple[float, float]:
        m = scrape(split_stack["verifier"].metrics_port)
        return tuple(m[f'specsplit_prefix_cache_tokens_total{{outcome="{o}",service="verifier"}}']
                     for o in ("hit", "queried"))

    ids = [3 + (j * 29) % 250 for j in range(40)]
    before = hits()
    out = _grpc_choices(split_stack, prompt_token_ids=ids, max_tokens=6, n=3, ignore_eos=True)
    after = hits()
    assert after[1] - before[1] == 3 * 40 and after[0] - before[0] == 2 * 32, (before, after)
    for c in out.values():
        expect_greedy(ids, c["tokens"], 6, ignore_eos=True)
    assert wait_for(lambda: _idle(split_stack), 10.0) is not None


def test_the_choices_bench_reports_each_server_s_time_and_hits(split_stack, capsys):
    """tools/choices_bench.py against this stack's HTTP API (one server, 2 rounds): a median time and
    the prefix hits of the choices that took the prompt from the cache."""
    from tests.helpers.tools import load_tool

    bench = load_tool("choices_bench")
    server = f"s=http://127.0.0.1:{split_stack.http_port},http://127.0.0.1:{split_stack['verifier'].metrics_port}/metrics"
    assert bench.main(["--server", server, "--rounds", "2", "--repeat", "1",
                       "--n", "3", "--max-tokens", "4"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("s: median ") and "over 2 requests (n 3," in last
    hits, queried = (float(x) for x in last.split("prefix hits per request: ")[1].split(" prompt")[0].split(" of "))
    # choices 1 and 2 take every full block (the tiny tokenizer reads both rounds' prompts alike, so a
    # second round's choice 0 may hit too)
    assert queried > 0 and hits >= 2 * 16 * ((queried / 3 - 1) // 16) > 0


@pytest.mark.parametrize("n", [0, 17])
def test_n_out_of_range_is_400(split_stack, prompts, n):
    status, raw = http_call(split_stack.http_port, "/v1/completions",
                            {"model": _model(split_stack), "prompt": prompts[0], "max_tokens": 2, "n": n})
    err = json.loads(raw)["error"]
    assert status == 400 and err["param"] == "n" and "n must be in [1, 16]" in err["message"]


# ---- a batch of prompts (/v1/completions) -------------------------------------------------------
def test_a_batch_of_prompts_is_each_prompt_s_own_choices(split_stack, prompts):
    """Choice i answers prompt i // n (OpenAI's order) exactly as that prompt alone with n does,
    greedy and seeded; the usage counts each prompt once; nothing stays allocated."""
    batch = [prompts[1], prompts[2], prompts[5]]
    for extra in (dict(temperature=0), dict(temperature=1.0, seed=77)):
        out = _post(split_stack, "/v1/completions", prompt=batch, max_tokens=8, n=2, ignore_eos=True, **extra)
        texts = _texts(out)
        assert len(texts) == 6
        for i, ids in enumerate(batch):
            alone = _post(split_stack, "/v1/completions", prompt=ids, max_tokens=8, n=2, ignore_eos=True, **extra)
            assert texts[2 * i: 2 * i + 2] == _texts(alone)
        assert out["usage"]["prompt_tokens"] == sum(len(ids) for ids in batch)
        assert out["usage"]["completion_tokens"] == 6 * 8
    assert wait_for(lambda: _idle(split_stack), 10.0) is not None


def test_a_batch_scored_with_echo_is_each_prompt_s_own_scores(split_stack, prompts):
    """lm-eval's loglikelihood requests, batched: echo, logprobs, max_tokens 0."""
    batch = [prompts[4], prompts[9]]
    out = _post(split_stack, "/v1/completions", prompt=batch, max_tokens=0, echo=True, logprobs=1, temperature=0)
    for c, ids in zip(out["choices"], batch):
        alone = _post(split_stack, "/v1/completions", prompt=ids, max_tokens=0, echo=True, logprobs=1, temperature=0)
        assert c["logprobs"] == alone["choices"][0]["logprobs"] and c["text"] == alone["choices"][0]["text"]
        assert len(c["logprobs"]["token_logprobs"]) == len(ids) and c["logprobs"]["token_logprobs"][0] is None
    assert wait_for(lambda: _idle(split_stack), 10.0) is not None


def test_a_streamed_batch_sends_every_choice_and_the_summed_usage(split_stack, prompts):
    batch = [prompts[6], prompts[8]]
    status, raw = http_call(split_stack.http_port, "/v1/completions",
                            {"model": _model(split_stack), "prompt": batch, "max_tokens": 5, "n": 2, "temperature": 0,
                             "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200
    events = [line[len(b"data: "):] for line in raw.splitlines() if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    texts: dict[int, str] = {}
    for c in chunks[:-1]:
        for ch in c["choices"]:
            texts[ch["index"]] = texts.get(ch["index"], "") + ch["text"]
    whole = _post(split_stack, "/v1/completions", prompt=batch, max_tokens=5, n=2, temperature=0, ignore_eos=True)
    assert [texts[i] for i in range(4)] == _texts(whole)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] == sum(len(ids) for ids in batch)
    assert chunks[-1]["usage"]["completion_tokens"] == 4 * 5
    assert wait_for(lambda: _idle(split_stack), 10.0) is not None


@pytest.mark.parametrize("prompt, message", [
    ([[3, 4], []], "prompt 1 of the batch is empty"),
    ([], "the prompt is empty"),
    ([[5, 6]] * 33, "33 prompts x n 2 = 66 choices; at most 64 a request"),
])
def test_a_bad_batch_is_400(split_stack, prompt, message):
    status, raw = http_call(split_stack.http_port, "/v1/completions",
                            {"model": _model(split_stack), "prompt": prompt, "max_tokens": 2, "n": 2})
    err = json.loads(raw)["error"]
    assert status == 400 and err["param"] == "prompt" and message in err["message"], raw


def test_a_batch_with_one_prompt_refused_frees_the_others(split_stack, prompts):
    """The third prompt does not fit max_model_len (256): 400 naming it, and the two submitted
    before it are aborted (nothing left running or allocated)."""
    batch = [prompts[0], prompts[1], [7] * 300]
    status, raw = http_call(split_stack.http_port, "/v1/completions",
                            {"model": _model(split_stack), "prompt": batch, "max_tokens": 200, "ignore_eos": True})
    assert status == 400 and "prompt (300 tokens)" in json.loads(raw)["error"]["message"], raw
    assert wait_for(lambda: _idle(split_stack), 10.0) is not None


# ---- gRPC ------------------------------------------------------------------------------------
def _grpc_choices(stack, **kw) -> dict[int, dict]:
    """Each choice's tokens, finish_reason and usage, from one Generate stream."""
    out: dict[int, dict] = {}
    with grpc.insecure_channel(stack.gateway) as ch:
        for r in gateway_pb2_grpc.GatewayStub(ch).Generate(gateway_pb2.GenerateRequest(**kw), timeout=60):
            c = out.setdefault(r.index, {"tokens": [], "finish": None, "usage": None})
            assert c["finish"] is None, f"choice {r.index} sent a message after its last"
            c["tokens"] += list(r.token_ids)
            if r.finish_reason:
                c["finish"], c["usage"] = r.finish_reason, r.usage
    return out


def test_grpc_greedy_n_choices_are_the_target_s_completion(split_stack, prompts):
    ids = prompts[3]
    out = _grpc_choices(split_stack, prompt_token_ids=ids, max_tokens=12, n=3, ignore_eos=True)
    (one,) = _grpc_choices(split_stack, prompt_token_ids=ids, max_tokens=12, ignore_eos=True).values()
    assert sorted(out) == [0, 1, 2]
    for c in out.values():
        assert c["tokens"] == one["tokens"] and len(c["tokens"]) == 12 and c["finish"] == "length"
        assert c["usage"].completion_tokens == 12 and c["usage"].prompt_tokens == len(ids)
    assert wait_for(lambda: _idle(split_stack), 10.0) is not None


def test_grpc_seeded_n_choices_are_each_seed_s_own(split_stack, prompts):
    ids = prompts[7]
    kw = dict(prompt_token_ids=ids, max_tokens=10, temperature=1.0, ignore_eos=True)
    out = _grpc_choices(split_stack, seed=123, n=3, **kw)
    for i in range(3):
        (alone,) = _grpc_choices(split_stack, seed=123 + i, **kw).values()
        assert out[i]["tokens"] == alone["tokens"]
    assert len({tuple(c["tokens"]) for c in out.values()}) > 1
    assert wait_for(lambda: _idle(split_stack), 10.0) is not None


@pytest.mark.parametrize("rid, ok", [("é" * 64, True), ("x" * 129, False)])
def test_grpc_choices_of_a_request_id_at_its_bound(split_stack, prompts, rid, ok):
    """A request_id of 128 bytes (the bound) takes n choices, whose ids are cut to fit their suffix;
    one of 129 is refused naming its own length."""
    kw = dict(prompt_token_ids=prompts[2], max_tokens=3, n=3, ignore_eos=True, request_id=rid)
    if ok:
        assert sorted(_grpc_choices(split_stack, **kw)) == [0, 1, 2]
        return
    with pytest.raises(grpc.RpcError) as err:
        _grpc_choices(split_stack, **kw)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id is 129 bytes" in err.value.details()


def test_grpc_n_out_of_range_is_invalid_argument(split_stack, prompts):
    with pytest.raises(grpc.RpcError) as err:
        _grpc_choices(split_stack, prompt_token_ids=prompts[0], max_tokens=2, n=17)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "n must be in [1, 16], got 17" in err.value.details()
