"""Bad input against the `plain` stack: an oversized GenerateRequest is RESOURCE_EXHAUSTED (the
gateway's --max-request-bytes, 4 MiB by default); hypothesis-generated GenerateRequests, and raw
random Session messages sent straight to the drafter and the verifier, never get UNKNOWN or
INTERNAL and never kill a process; afterwards nothing is left running and every KV block is free."""
from __future__ import annotations

import math

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specsplit.v1 import (common_pb2, drafter_pb2, drafter_pb2_grpc, gateway_pb2, verifier_pb2,
                                 verifier_pb2_grpc)
from tests.services.procs import generate, request, service_info, wait_for

BAD_CODES = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}
EXPECTED = {"OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"}
FUZZ_EXAMPLES = 60
CALL_TIMEOUT_S = 20.0
seen: dict[str, dict[str, int]] = {"generate": {}, "drafter": {}, "verifier": {}}


def _state(stack):
    v = service_info(stack["verifier"].address, "verifier")
    d = service_info(stack["drafter"].address, "drafter")
    return (v.num_running, d.num_running, v.kv.free_blocks, d.kv.free_blocks)


@pytest.fixture(scope="module")
def baseline(plain_stack):
    assert wait_for(lambda: _state(plain_stack)[:2] == (0, 0), 10) is not None
    return _state(plain_stack)


def _alive(stack):
    return all(p.alive() for p in stack.procs.values())


def test_oversized_request_is_resource_exhausted(plain_stack, baseline):
    big = gateway_pb2.GenerateRequest(prompt="a" * (64 * 1024 * 1024), max_tokens=4, top_p=1.0)
    with pytest.raises(grpc.RpcError) as err:
        generate(plain_stack.gateway, big, timeout=60)
    print(f"FIGURE oversize: 64 MiB prompt -> {err.value.code().name}: {err.value.details()}")
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # Below the limit but past max_model_len: an ordinary INVALID_ARGUMENT, allocated nothing.
    with pytest.raises(grpc.RpcError) as err:
        generate(plain_stack.gateway, request([5] * 200_000, max_tokens=4), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert _alive(plain_stack) and _state(plain_stack) == baseline


# ---- the public API ---------------------------------------------------------------------------
f32 = st.floats(width=32)
small_or_any = lambda lo, hi, small: st.one_of(st.integers(0, small), st.integers(lo, hi))  # noqa: E731

# A valid request, then up to two fields replaced by anything their proto type allows.
VALID = {
    "prompt": st.text(min_size=1, max_size=20),
    "prompt_token_ids": st.lists(st.integers(3, 255), min_size=1, max_size=20),
    "max_tokens": st.integers(1, 6),
    "temperature": st.one_of(st.sampled_from([0.0, 0.7, 1.0]), st.floats(0.0625, 2.0, width=32)),
    "top_p": st.one_of(st.just(1.0), st.floats(0.0625, 1.0, width=32)),
    "top_k": st.integers(0, 50),
    "seed": st.one_of(st.none(), st.integers(0, 2**64 - 1)),
    "ignore_eos": st.booleans(),
    "stop": st.lists(st.text(min_size=1, max_size=4), max_size=3),
    "request_id": st.text(max_size=12),
    "num_speculative_tokens": st.integers(0, 8),
    "disable": st.booleans(),
}
WILD = {
    "prompt": st.text(max_size=60),
    "prompt_token_ids": st.lists(st.integers(-2**31, 2**31 - 1), max_size=24),
    "max_tokens": st.integers(0, 2**32 - 1),
    "temperature": f32,
    "top_p": f32,
    "top_k": st.integers(-2**31, 2**31 - 1),
    "seed": st.integers(0, 2**64 - 1),
    "ignore_eos": st.booleans(),
    "stop": st.lists(st.text(max_size=6), max_size=20),
    "request_id": st.text(max_size=200),
    "num_speculative_tokens": st.integers(0, 2**32 - 1),
    "disable": st.booleans(),
}


@st.composite
def generate_requests(draw):
    fields = {name: draw(strategy) for name, strategy in VALID.items()}
    wild = draw(st.lists(st.sampled_from(sorted(WILD)), max_size=2, unique=True))
    if "prompt_token_ids" not in wild and draw(st.booleans()):
        fields["prompt_token_ids"] = []  # use the text prompt
    for name in wild:
        fields[name] = draw(WILD[name])
    seed, nst, disable = fields.pop("seed"), fields.pop("num_speculative_tokens"), fields.pop("disable")
    req = gateway_pb2.GenerateRequest(**fields)
    if seed is not None:
        req.seed = seed
    req.speculation.num_speculative_tokens = nst
    req.speculation.disable = disable
    return req


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(req=generate_requests())
def test_fuzzed_generate_requests_never_internal(plain_stack, baseline, req):
    try:
        out = generate(plain_stack.gateway, req, timeout=CALL_TIMEOUT_S)
        code = "OK"
        assert out["finish_reason"] in ("length", "stop")
    except grpc.RpcError as e:
        code = e.code().name
        assert e.code() not in BAD_CODES, f"{code}: {e.details()} for {req}"
        assert e.details()
    seen["generate"][code] = seen["generate"].get(code, 0) + 1
    assert code in EXPECTED, f"{code} for {req}"
    assert plain_stack["gateway"].alive()


def test_fuzz_left_nothing_behind(plain_stack, baseline):
    print(f"FIGURE fuzz generate: {sum(seen['generate'].values())} requests -> {seen['generate']}")
    assert wait_for(lambda: _state(plain_stack) == baseline, 5) is not None, (_state(plain_stack), baseline)
    assert _alive(plain_stack)


# ---- raw Session messages to the drafter and the verifier -------------------------------------
seq_ids = st.one_of(st.sampled_from(["a", "b", "c"]), st.text(max_size=6))
token_ids = st.lists(st.one_of(st.integers(0, 260), st.integers(-2**31, 2**31 - 1)), max_size=12)
f64 = st.one_of(st.sampled_from([0.0, 0.8, 1.0]), st.floats())
params = st.builds(lambda t, p, k: common_pb2.SamplingParams(temperature=t, top_p=p, top_k=k), f64,
                   st.one_of(st.just(1.0), f64), st.one_of(st.integers(0, 20), st.integers(-2**31, 2**31 - 1)))
adds = st.builds(lambda seqs: common_pb2.AddSeqs(seqs=seqs), st.lists(
    st.builds(lambda s, ids, p: common_pb2.SeqAdd(seq_id=s, prompt_token_ids=ids, params=p), seq_ids, token_ids, params),
    max_size=3))
releases = st.builds(lambda ids: common_pb2.Release(seq_ids=ids), st.lists(seq_ids, max_size=3))
rows = st.builds(lambda s, size, values, indices, sparse: common_pb2.PackedRow(seq_id=s, size=size, values=values,
                                                                                indices=indices, sparse=sparse),
                 seq_ids, small_or_any(0, 2**32 - 1, 300), st.binary(max_size=64), st.binary(max_size=32), st.booleans())
k_values = small_or_any(0, 2**32 - 1, 6)

drafter_requests = st.one_of(
    adds.map(lambda m: drafter_pb2.DrafterRequest(add=m)),
    st.lists(st.builds(lambda s, ids, k: drafter_pb2.ProposeItem(seq_id=s, new_token_ids=ids, k=k), seq_ids, token_ids,
                       k_values), max_size=3).map(lambda items: drafter_pb2.DrafterRequest(propose=drafter_pb2.ProposeBatch(items=items))),
    st.lists(st.builds(lambda s, pos: drafter_pb2.RowRequest(seq_id=s, position=pos), seq_ids, k_values), max_size=3)
    .map(lambda f: drafter_pb2.DrafterRequest(fetch_rows=drafter_pb2.FetchRows(fetch=f))),
    releases.map(lambda m: drafter_pb2.DrafterRequest(release=m)),
    st.just(drafter_pb2.DrafterRequest()),
)
verifier_requests = st.one_of(
    adds.map(lambda m: verifier_pb2.VerifierRequest(add=m)),
    st.lists(st.builds(lambda s, ids, probs, one: verifier_pb2.VerifyItem(seq_id=s, draft_token_ids=ids, draft_probs=probs,
                                                                          draft_probs_one=one),
                       seq_ids, token_ids, st.lists(f32, max_size=8), st.booleans()), max_size=3)
    .map(lambda items: verifier_pb2.VerifierRequest(verify=verifier_pb2.VerifyBatch(items=items))),
    st.lists(rows, max_size=2).map(lambda r: verifier_pb2.VerifierRequest(resolve=verifier_pb2.ResolveBatch(rows=r))),
    releases.map(lambda m: verifier_pb2.VerifierRequest(release=m)),
    st.just(verifier_pb2.VerifierRequest()),
)


def _session(address: str, stub_cls, messages) -> list:
    for i, m in enumerate(messages, 1):
        m.id = i
    with grpc.insecure_channel(address) as ch:
        return list(stub_cls(ch).Session(iter(messages), timeout=CALL_TIMEOUT_S))


def _check_session(stack, role, stub_cls, messages):
    try:
        responses = _session(stack[role].address, stub_cls, messages)
    except grpc.RpcError as e:  # only a broken stream is a status; none of these should break it
        pytest.fail(f"{role} Session ended with {e.code().name}: {e.details()} after {messages}")
    assert [r.id for r in responses] == [m.id for m in messages]
    for m, r in zip(messages, responses):
        code = grpc.StatusCode.OK if not r.HasField("error") else next(c for c in grpc.StatusCode if c.value[0] == r.error.code)
        seen[role][code.name] = seen[role].get(code.name, 0) + 1
        assert code not in BAD_CODES, f"{role}: {code.name}: {r.error.message} for {m}"
    assert stack[role].alive()


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(messages=st.lists(drafter_requests, min_size=1, max_size=6))
def test_raw_drafter_messages_never_internal(plain_stack, baseline, messages):
    _check_session(plain_stack, "drafter", drafter_pb2_grpc.DrafterStub, messages)


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(messages=st.lists(verifier_requests, min_size=1, max_size=6))
def test_raw_verifier_messages_never_internal(plain_stack, baseline, messages):
    _check_session(plain_stack, "verifier", verifier_pb2_grpc.VerifierStub, messages)


def test_raw_sessions_left_nothing_behind(plain_stack, baseline, prompts):
    print(f"FIGURE fuzz internal: drafter responses {seen['drafter']}, verifier responses {seen['verifier']}")
    assert wait_for(lambda: _state(plain_stack) == baseline, 5) is not None, (_state(plain_stack), baseline)
    assert _alive(plain_stack)
    out = generate(plain_stack.gateway, request(prompts[0], max_tokens=8, ignore_eos=True))
    assert len(out["token_ids"]) == 8 and math.isfinite(out["usage"]["proposed_draft_tokens"])
