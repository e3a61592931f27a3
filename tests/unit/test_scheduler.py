"""The one Scheduler (specsplit/scheduler.py): KV-aware admission and preemption on tiny caches.

In-process engines (the gateway runs the same Scheduler over gRPC clients; tests/services covers
that). Every stream's greedy tokens must equal a solo target-only run, whatever was preempted,
cancelled or queued, and every KV block must come back on both engines.
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from specsplit.config import EngineConfig, SpecConfig
from specsplit.factory import build_colocated
from specsplit.request import GenerationRequest, RequestError
from specsplit.scheduler import KvBudget, Observer, Scheduler
from tests.helpers.colocated import greedy_alone

MAX_LEN = 128
BLOCKS = 12  # x 16 tokens = 192 tokens per cache: two requests of 96 tokens fill it


def _colo(target, draft, num_blocks, k=3):
    tc = EngineConfig(model=str(target), max_model_len=MAX_LEN, max_num_seqs=8, max_prefill_tokens=64,
                      num_blocks=num_blocks)
    dc = EngineConfig(model=str(draft), max_model_len=MAX_LEN, max_num_seqs=8, max_prefill_tokens=64,
                      num_blocks=num_blocks) if draft else None
    return build_colocated(tc, dc, SpecConfig(num_speculative_tokens=k if draft else 0), show_progress=False)


@pytest.fixture(scope="module")
def tight(tiny_llama, tiny_draft_close):
    colo = _colo(tiny_llama, tiny_draft_close, BLOCKS)
    yield colo
    colo.close()


@pytest.fixture(scope="module")
def tiniest(tiny_llama, tiny_draft_close):
    """8 blocks x 16 = 128 tokens = max_model_len: any request fits alone, two rarely do."""
    colo = _colo(tiny_llama, tiny_draft_close, 8)
    yield colo
    colo.close()


@pytest.fixture(scope="module")
def solo(tiny_llama):
    """solo(prompt, max_tokens) -> greedy tokens of the target alone, one request at a time."""
    colo = _colo(tiny_llama, None, 64)
    yield greedy_alone(colo)
    colo.close()


class Counting(Observer):
    def __init__(self):
        self.preempted: list[str] = []
        self.outcomes: dict[str, str] = {}

    def on_preempt(self, request):
        self.preempted.append(request.request_id)

    def on_finish(self, request, outcome):
        self.outcomes[request.request_id] = outcome


def _free(colo) -> dict[str, int]:
    return {"verifier": colo.target.block_manager.num_free_blocks, "drafter": colo.drafter.block_manager.num_free_blocks}


def _prompt(i: int, n: int) -> tuple[int, ...]:
    return tuple(3 + (i * 37 + j * 11) % 250 for j in range(n))


def test_kv_pressure_preempts_instead_of_failing(tight, solo):
    """5 requests of 16 prompt + 80 new tokens on a 192-token cache: they are admitted while their
    prompts fit, outgrow it, and are preempted and resumed: all finish, greedy == solo."""
    before = _free(tight)
    obs = Counting()
    sched = Scheduler(tight.decoder, tight.eos_token_ids, max_num_seqs=8, observer=obs)
    streamed: dict[str, list[int]] = {}
    reqs = [GenerationRequest(f"p{i}", _prompt(i, 16), 80, ignore_eos=True) for i in range(5)]
    done = sched.run(reqs, on_tokens=lambda r, kept: streamed.setdefault(r.request_id, []).extend(kept))
    assert [r.finish_reason for r in done] == ["length"] * 5
    for r in done:
        assert r.output == solo(r.prompt_token_ids, 80), r.request_id
        assert streamed[r.request_id] == r.output  # nothing lost or repeated in the stream
    assert sched.preemptions > 0 and obs.preempted
    assert set(obs.outcomes.values()) == {"length"}
    assert _free(tight) == before and not tight.decoder.tracks


def test_seeded_sampling_unchanged_by_preemption(tight):
    """Random streams are keyed by request seed and position, so a preempted and recomputed
    sampled request draws what it would have drawn alone."""
    from specsplit.sampling.params import SamplingParams

    def reqs():
        return [GenerationRequest(f"s{i}", _prompt(i, 16), 80, SamplingParams(0.8, 1.0, 0, 100 + i), ignore_eos=True)
                for i in range(5)]

    sched = Scheduler(tight.decoder, tight.eos_token_ids, max_num_seqs=8)
    crowded = sched.run(reqs())
    assert sched.preemptions > 0
    for req, alone_spec in zip(crowded, reqs()):
        (alone,) = Scheduler(tight.decoder, tight.eos_token_ids, 1).run([alone_spec])
        assert req.output == alone.output, req.request_id


def test_request_that_can_never_fit_is_refused_up_front(tight):
    sched = Scheduler(tight.decoder, tight.eos_token_ids, 8)
    with pytest.raises(RequestError) as e:
        sched.submit(GenerationRequest("big", _prompt(0, 100), 100))
    assert e.value.kind == RequestError.INVALID and "exceeds max_model_len 128" in str(e.value)
    # under max_model_len but over the whole cache of 192 tokens:
    small = Scheduler(tight.decoder, tight.eos_token_ids, 8, kv=[KvBudget("verifier", 4, 16)])
    with pytest.raises(RequestError, match="verifier's whole KV cache holds 64 tokens"):
        small.submit(GenerationRequest("mid", _prompt(0, 40), 40))
    assert not sched.has_work and not small.has_work


def test_request_id_is_bounded(tight):
    sched = Scheduler(tight.decoder, tight.eos_token_ids, 8)
    with pytest.raises(RequestError, match="at most 128"):
        sched.submit(GenerationRequest("x" * 129, (5, 6, 7), 4))
    req = sched.submit(GenerationRequest("x" * 128, (5, 6, 7), 4))
    assert len(req.seq_id) <= 16  # engines see a short internal id
    sched.abort(req)
    sched.step()
    assert not sched.has_work


def test_abort_from_another_thread_ends_the_stream_before_the_step_returns(tight):
    """An abort finishes the stream at once; the step thread frees the sequence afterwards."""
    events = []
    sched = Scheduler(tight.decoder, tight.eos_token_ids, 8)
    req = sched.submit(GenerationRequest("a", _prompt(1, 10), 40, ignore_eos=True), sink=events.append)
    sched.step()
    inner = tight.decoder.step

    def step_with_cancel(budgets, prefill=None):  # the cancel arrives while the engines work
        sched.abort(req)
        events.append("abort returned")
        return inner(budgets, prefill)

    tight.decoder.step = step_with_cancel
    try:
        sched.step()
    finally:
        del tight.decoder.step
    assert events[-2].finish_reason == "abort" and events[-1] == "abort returned"
    assert sched.inflight == 0 and not sched.running and not tight.decoder.tracks


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_property_random_arrivals_cancels_preemptions(tiniest, solo, data):
    """Random arrivals, cancels, lengths and prefill budgets on a tiny cache: every stream == solo
    run (a cancelled one: a prefix of it), streamed == output, and every block comes back on both
    engines (also for requests cancelled or preempted between the pieces of their prompt)."""
    before = _free(tiniest)
    n = data.draw(st.integers(3, 6), label="requests")
    specs = []
    for i in range(n):
        plen = data.draw(st.integers(1, 60), label=f"prompt{i}")
        new = data.draw(st.integers(1, MAX_LEN - plen), label=f"new{i}")
        arrive = data.draw(st.integers(0, 12), label=f"arrive{i}")
        cancel = data.draw(st.none() | st.integers(0, 30), label=f"cancel{i}")
        specs.append((GenerationRequest(f"q{i}", _prompt(i + 7 * plen, plen), new, ignore_eos=True), arrive, cancel))
    max_num_seqs = data.draw(st.integers(2, 4), label="max_num_seqs")
    budget = data.draw(st.none() | st.integers(4, 48), label="max_num_batched_tokens")  # chunked prefill
    sched = Scheduler(tiniest.decoder, tiniest.eos_token_ids, max_num_seqs, max_num_batched_tokens=budget)
    streamed: dict[str, list[int]] = {}
    finals: dict[str, str] = {}

    def sink_for(rid):
        def sink(ev):
            assert rid not in finals, "event after the end of the stream"
            streamed.setdefault(rid, []).extend(ev.token_ids)
            if ev.finish_reason is not None or ev.error is not None:
                finals[rid] = ev.finish_reason or ev.error.kind
        return sink

    live = {}
    step = 0
    while step < 2000:
        for spec, arrive, cancel in specs:
            rid = spec.request_id
            if arrive == step:
                live[rid] = sched.submit(spec, sink=sink_for(rid))
            if cancel is not None and rid in live and step == arrive + cancel:
                sched.abort(live[rid])
        if step > 30 and not sched.has_work:
            break
        sched.step()
        step += 1
    assert not sched.has_work and sched.inflight == 0
    event(f"preempted: {sched.preemptions > 0}")
    for spec, _, cancel in specs:
        req = live[spec.request_id]
        want = solo(spec.prompt_token_ids, spec.max_tokens)
        assert streamed.get(spec.request_id, []) == req.output
        if finals[spec.request_id] == "abort":
            assert cancel is not None and req.output == want[: len(req.output)]
        else:
            assert finals[spec.request_id] == "length" and req.output == want
    assert _free(tiniest) == before and not tiniest.decoder.tracks
    assert not tiniest.target.seqs and not tiniest.drafter.seqs


def test_a_request_asking_more_than_the_servers_k_gets_the_servers_k(tight, solo):
    """A request's num_speculative_tokens above the server's K (3 here) is capped at it: the KV
    reservation and the engines' forward bound are sized for the server's K. Same tokens."""
    prompt = (5, 6, 7, 8) * 4
    (state,) = Scheduler(tight.decoder, tight.eos_token_ids, 4).run(
        [GenerationRequest("greedy-k8", prompt, 24, ignore_eos=True, num_speculative_tokens=8)])
    assert state.output == solo(prompt, 24)
    assert 0 < len(state.accepted_per_position) <= 3 and state.proposed <= 3 * state.speculative_steps
    assert tight.decoder.request_k(8) == 3 and tight.decoder.request_k(2) == 2 and tight.decoder.request_k(0) == 3


def test_a_step_failure_naming_one_sequence_ends_that_request_alone(tight, solo):
    """The verifier loses one running sequence (released behind the scheduler's back: the next
    verify refuses "unknown sequence 'rN' on the verifier"). That request ends with INTERNAL (it
    was valid: the server failed it, so not INVALID_ARGUMENT, which tells a client to change its
    request); the others go on to the tokens they have alone; every block comes back."""
    free = _free(tight)
    sched = Scheduler(tight.decoder, tight.eos_token_ids, decode=None)
    reqs = [GenerationRequest(f"q{i}", _prompt(i, 20), 24, ignore_eos=True) for i in range(3)]
    live = [sched.submit(r) for r in reqs]
    while not all(len(r.output) >= 2 for r in live):
        sched.step()
    victim = live[1]
    tight.target.release([victim.seq_id])
    while sched.has_work:
        sched.step()
    assert victim.error is not None and victim.error.kind == RequestError.INTERNAL
    assert f"unknown sequence '{victim.seq_id}'" in victim.error.message and "could not run" in victim.error.message
    for r in (live[0], live[2]):
        assert r.error is None and r.output == solo(r.request.prompt_token_ids, 24)
    assert _free(tight) == free
