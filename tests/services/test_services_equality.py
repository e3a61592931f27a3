"""Greedy output is the target's, token for token: split (3 processes) == colocated == target-only,
one stream at a time and 8 concurrent streams (continuous batching).

The reference is the target alone at batch 1; a stream here runs in other batches and verifies
K+1 tokens per step, so a difference is accepted only at a certified near-tie of the target
(tests/helpers/greedy.py)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from specsplit.v1 import gateway_pb2
from tests.helpers.greedy import assert_greedy_equal_or_tie
from tests.services.procs import generate, request

MAX_TOKENS = 24


def _run_all(address, prompts, concurrency, **kw):
    reqs = [request(ids, max_tokens=MAX_TOKENS, **kw) for ids in prompts]
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda r: generate(address, r), reqs))


@pytest.mark.parametrize("concurrency", [1, 8])
def test_greedy_split_equals_colocated_equals_target(split_stack, colocated_stack, prompts, reference, target_logits,
                                                     concurrency):
    batch = prompts[:8]
    split = _run_all(split_stack.gateway, batch, concurrency, ignore_eos=True)
    colocated = _run_all(colocated_stack.gateway, batch, concurrency, ignore_eos=True)
    for ids, s, c in zip(batch, split, colocated):
        expected = reference(ids, MAX_TOKENS, ignore_eos=True)
        assert_greedy_equal_or_tie(expected, target_logits, s["token_ids"], prompt=ids)
        assert_greedy_equal_or_tie(expected, target_logits, c["token_ids"], prompt=ids)
        assert s["finish_reason"] == c["finish_reason"] == "length"
        if s["token_ids"] == c["token_ids"]:
            assert s["text"] == c["text"]
        assert s["usage"]["completion_tokens"] == MAX_TOKENS
        assert s["usage"]["prompt_tokens"] == len(ids)
    # The close draft agrees often: speculation really ran in both modes.
    assert sum(r["usage"]["accepted_draft_tokens"] for r in split) > 0
    assert sum(r["usage"]["accepted_draft_tokens"] for r in colocated) > 0


def test_streaming_messages_and_eos(split_stack, prompts, reference, target_logits):
    """Tokens arrive over several messages; without ignore_eos, generation stops at EOS like the target."""
    for ids in prompts[8:12]:
        out = generate(split_stack.gateway, request(ids, max_tokens=40))
        expected = reference(ids, 40)
        cmp = assert_greedy_equal_or_tie(expected, target_logits, out["token_ids"], prompt=ids)
        assert out["messages"] >= 2
        if cmp.equal:
            assert out["finish_reason"] == ("stop" if expected[-1] == 2 and len(expected) < 40 else "length")


def test_speculation_disabled_and_custom_k(split_stack, prompts, reference, target_logits):
    ids = prompts[12]
    off = generate(split_stack.gateway, request(ids, max_tokens=MAX_TOKENS, ignore_eos=True,
                                                speculation=gateway_pb2.Speculation(disable=True)))
    k1 = generate(split_stack.gateway, request(ids, max_tokens=MAX_TOKENS, ignore_eos=True,
                                               speculation=gateway_pb2.Speculation(num_speculative_tokens=1)))
    expected = reference(ids, MAX_TOKENS, ignore_eos=True)
    assert_greedy_equal_or_tie(expected, target_logits, off["token_ids"], prompt=ids)
    assert_greedy_equal_or_tie(expected, target_logits, k1["token_ids"], prompt=ids)
    assert off["usage"]["proposed_draft_tokens"] == 0
    assert 0 < k1["usage"]["proposed_draft_tokens"] <= MAX_TOKENS


def test_stop_token_ids_end_the_stream_at_the_first_one(split_stack, colocated_stack, prompts):
    """stop_token_ids over gRPC and HTTP, speculation on: the output is the unstopped greedy output
    through the first stop token (kept), finish_reason "stop"; even with ignore_eos. Out of the
    vocabulary: INVALID_ARGUMENT / 400 naming the field."""
    import json

    import grpc

    from tests.services.procs import http_call

    ids = prompts[10]
    base = generate(split_stack.gateway, request(ids, max_tokens=16, ignore_eos=True))["token_ids"]
    j = next(j for j in range(3, len(base)) if base[j] not in base[:j])  # a token's first appearance
    want = base[: j + 1]
    for stack in (split_stack, colocated_stack):
        out = generate(stack.gateway, request(ids, max_tokens=16, ignore_eos=True, stop_token_ids=[base[j], 0]))
        assert out["token_ids"] == want and out["finish_reason"] == "stop"
    model = json.loads(http_call(split_stack.http_port, "/v1/models")[1])["data"][0]["id"]
    status, raw = http_call(split_stack.http_port, "/v1/completions",
                            {"model": model, "prompt": ids, "max_tokens": 16, "temperature": 0,
                             "stop_token_ids": [base[j]], "logprobs": 0})
    choice = json.loads(raw)["choices"][0]
    assert status == 200 and choice["finish_reason"] == "stop" and len(choice["logprobs"]["tokens"]) == j + 1
    with pytest.raises(grpc.RpcError) as err:
        generate(split_stack.gateway, request(ids, max_tokens=4, stop_token_ids=[5, 10**6]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "stop_token_ids [1000000]" in err.value.details()
    status, raw = http_call(split_stack.http_port, "/v1/completions", {"model": model, "prompt": ids, "max_tokens": 4,
                                                                      "stop_token_ids": [10**6]})
    err = json.loads(raw)["error"]
    assert status == 400 and err["param"] == "stop_token_ids" and "outside the vocabulary" in err["message"], raw


def test_min_tokens_holds_back_the_stop_ids_and_stays_lossless(split_stack, colocated_stack, prompts, target_logits):
    """min_tokens over gRPC (split and colocated, speculation on) and HTTP: the stop ids are tokens
    the free output takes early, so holding them back changes the output; it equals the stack's own
    target-only output with the same min_tokens (or a certified near-tie of the held-back target).
    min_tokens above max_tokens, or negative on HTTP, is INVALID_ARGUMENT / 400 naming the field."""
    import json

    import grpc

    from specsplit.sampling.params import SamplingParams
    from tests.helpers.structured import constrained_next_logits
    from tests.services.procs import http_call, server_info

    ids, n, held = prompts[11], 8, 16
    free = generate(split_stack.gateway, request(ids, max_tokens=held, ignore_eos=True))["token_ids"]
    stops = [free[1], free[4]]
    eos = list(server_info(split_stack.gateway).eos_token_ids)
    off = generate(split_stack.gateway, request(ids, max_tokens=held, stop_token_ids=stops, min_tokens=n,
                                                speculation=gateway_pb2.Speculation(disable=True)))["token_ids"]
    assert off[1] != free[1] and not set(off[:n]) & set(stops + eos) and len(off) > n
    params = SamplingParams(min_tokens=n, min_tokens_stop_ids=tuple(sorted(set(stops + eos))))
    f = constrained_next_logits(target_logits, params, len(ids), None)
    for stack in (split_stack, colocated_stack):
        out = generate(stack.gateway, request(ids, max_tokens=held, stop_token_ids=stops, min_tokens=n))
        assert out["usage"]["proposed_draft_tokens"] > 0
        assert_greedy_equal_or_tie(off, f, out["token_ids"], prompt=ids)
    model = json.loads(http_call(split_stack.http_port, "/v1/models")[1])["data"][0]["id"]
    status, raw = http_call(split_stack.http_port, "/v1/completions",
                            {"model": model, "prompt": ids, "max_tokens": held, "temperature": 0, "logprobs": 0,
                             "stop_token_ids": stops, "min_tokens": n})
    tokens = json.loads(raw)["choices"][0]["logprobs"]["tokens"]
    assert status == 200 and len(tokens) == len(off), raw
    with pytest.raises(grpc.RpcError) as err:
        generate(split_stack.gateway, request(ids, max_tokens=4, min_tokens=5))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "min_tokens (5) must be <= max_tokens (4)" in err.value.details()
    for bad, needle in ((5, "must be <= max_tokens"), (-1, "must be >= 0")):
        status, raw = http_call(split_stack.http_port, "/v1/completions",
                                {"model": model, "prompt": ids, "max_tokens": 4, "min_tokens": bad})
        err = json.loads(raw)["error"]
        assert status == 400 and err["param"] == "min_tokens" and needle in err["message"], raw


def test_text_prompt_and_stop_string(split_stack, colocated_stack):
    """Text prompts use the target's tokenizer; a stop string ends the stream and is not sent."""
    base = generate(split_stack.gateway, request(prompt="w5 w9 w13 w5 w9", max_tokens=12, ignore_eos=True))
    assert base["usage"]["prompt_tokens"] == 5
    words = base["text"].split(" ")
    j = next(j for j in range(2, len(words) - 1) if words[j] not in words[1:j])
    stop = f" {words[j]} "  # a whole word with its separators (" w1" would also match " w12")
    out = generate(split_stack.gateway, request(prompt="w5 w9 w13 w5 w9", max_tokens=12, ignore_eos=True, stop=[stop]))
    assert out["finish_reason"] == "stop"
    assert out["text"] == " ".join(words[:j])
    assert stop not in out["text"]
    assert out["token_ids"] == base["token_ids"][: len(out["token_ids"])]
    colo = generate(colocated_stack.gateway, request(prompt="w5 w9 w13 w5 w9", max_tokens=12, ignore_eos=True, stop=[stop]))
    assert colo["text"] == out["text"] and colo["token_ids"] == out["token_ids"]
    kept = generate(split_stack.gateway, request(prompt="w5 w9 w13 w5 w9", max_tokens=12, ignore_eos=True, stop=[stop],
                                                 include_stop_str_in_output=True))
    assert kept["text"] == out["text"] + stop and kept["token_ids"] == out["token_ids"]
