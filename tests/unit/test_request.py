"""The one Request (specsplit/request.py): validation in one place, stop rules with the detokenizer,
usage and per-position acceptance counted once, and a finish that wins exactly once."""
from __future__ import annotations

import threading

import pytest

from specsplit.request import (GenerationRequest, Limits, Request, RequestError, TokenLogprob, validate,
                               with_min_tokens_stops)
from specsplit.sampling.params import Grammar, SamplingParams

LIMITS = Limits(vocab_size=100, max_model_len=64)


def _words(ids):
    return " ".join(f"w{i}" for i in ids)


@pytest.mark.parametrize("kw, message", [
    (dict(request_id="x" * 129), "at most 128"),
    (dict(request_id="é" * 65), "130 bytes"),
    (dict(prompt_token_ids=()), "prompt is empty"),
    (dict(max_tokens=0), "max_tokens must be >= 1"),
    (dict(prompt_token_ids=(1, 100)), "outside the vocabulary"),
    (dict(max_tokens=62), "exceeds max_model_len 64"),
    (dict(params=SamplingParams(temperature=-1.0)), "temperature"),
    (dict(params=SamplingParams(top_p=1.5)), "no nucleus filtering"),
    (dict(num_speculative_tokens=33), "num_speculative_tokens"),
    (dict(stop=("",)), "stop"),
    (dict(stop_token_ids=(5, 100)), "stop_token_ids [100] are outside the vocabulary"),
    (dict(stop_token_ids=tuple(range(65))), "stop_token_ids takes at most 64 token ids, got 65"),
    (dict(logprobs=21), "logprobs must be in [0, 20]"),
    (dict(logprobs=-1), "logprobs must be in [0, 20]"),
    (dict(params=SamplingParams(min_tokens=5)), "min_tokens (5) must be <= max_tokens (4)"),
    (dict(params=SamplingParams(min_tokens=-2)), "min_tokens must be >= 0"),
    (dict(params=SamplingParams(min_tokens=2, grammar=Grammar("json_object"))), "min_tokens cannot be combined with a grammar"),
])
def test_validation_is_one_function(kw, message):
    base = dict(request_id="r", prompt_token_ids=(1, 2, 3), max_tokens=4)
    with pytest.raises(RequestError) as err:
        validate(GenerationRequest(**{**base, **kw}), LIMITS)
    assert err.value.kind == RequestError.INVALID and message in err.value.message


def test_stop_string_eos_and_length():
    events = []
    req = Request(GenerationRequest("r", (1,), 10, stop=("w4",)), "r1", 1, _words, events.append)
    assert req.take([2, 3], eos_ids=[9]) == [2, 3] and not req.finished
    assert req.take([4, 5], eos_ids=[9]) == [4] and req.finish_reason == "stop"  # the stop string's token, no more
    req.finish()
    assert events[-1].text == "w2 w3 " and events[-1].finish_reason == "stop"
    eos = Request(GenerationRequest("e", (1,), 10), "r2", 2)
    assert eos.take([3, 9, 4], eos_ids=[9]) == [3, 9] and eos.finish_reason == "stop"
    ignore = Request(GenerationRequest("i", (1,), 3, ignore_eos=True), "r3", 3)
    assert ignore.take([9, 9, 9, 9], eos_ids=[9]) == [9, 9, 9] and ignore.finish_reason == "length"


def test_stop_token_ids_end_the_output_as_eos_does_even_with_ignore_eos():
    req = Request(GenerationRequest("s", (1,), 10, stop_token_ids=(7, 8)), "r1", 1)
    assert req.take([3, 4], eos_ids=[9]) == [3, 4] and not req.finished
    assert req.take([5, 8, 6], eos_ids=[9]) == [5, 8] and req.finish_reason == "stop"  # kept, nothing after it
    ignore = Request(GenerationRequest("i", (1,), 10, ignore_eos=True, stop_token_ids=(7,)), "r2", 2)
    assert ignore.take([9, 7, 4], eos_ids=[9]) == [9, 7] and ignore.finish_reason == "stop"


def test_the_token_that_ends_the_output_is_not_in_the_text():
    """vLLM's rule, on every API: EOS's text never; a stop_token_ids token's only with
    include_stop_str_in_output; an EOS that does not end the output (ignore_eos, before min_tokens)
    is text like any token. The tokens keep them all."""
    def run(tokens, **kw):
        events = []
        req = Request(GenerationRequest("t", (1,), 10, **kw), "r", 1, _words, events.append)
        kept = req.take(tokens, eos_ids=[9])
        req.finish("length")
        return kept, "".join(e.text for e in events)

    assert run([3, 9]) == ([3, 9], "w3")
    assert run([3, 9], include_stop_str_in_output=True) == ([3, 9], "w3")
    assert run([3, 7], stop_token_ids=(7,)) == ([3, 7], "w3")
    assert run([3, 7], stop_token_ids=(7,), include_stop_str_in_output=True) == ([3, 7], "w3 w7")
    assert run([3, 9, 4], ignore_eos=True) == ([3, 9, 4], "w3 w9 w4")
    assert run([9, 3, 9], params=SamplingParams(min_tokens=2)) == ([9, 3, 9], "w9 w3")


def test_min_tokens_holds_back_eos_stop_ids_and_stop_strings():
    """Before the (min_tokens + 1)-th token nothing stops the output (the engines never sample EOS or
    a stop id there; a stop string the text completes there does not count); from it on, they do."""
    params = SamplingParams(min_tokens=3)
    req = Request(GenerationRequest("m", (1,), 10, params, stop=("w4",), stop_token_ids=(7,)), "r1", 1, _words)
    assert req.take([9, 7, 4], eos_ids=[9]) == [9, 7, 4] and not req.finished
    assert req.take([5, 9, 6], eos_ids=[9]) == [5, 9] and req.finish_reason == "stop"  # EOS, token 5
    strings = Request(GenerationRequest("s", (1,), 10, params, stop=("w4 w5", "w5 w6")), "r2", 2, _words)
    assert strings.take([3, 4, 5], eos_ids=[9]) == [3, 4, 5] and not strings.finished  # "w4 w5" ends in token 3
    assert strings.take([6, 8], eos_ids=[9]) == [6] and strings.finish_reason == "stop"  # "w5 w6" ends in token 4
    assert strings.text.text == "w3 w4 "
    early = Request(GenerationRequest("e", (1,), 10, params, stop=("w4",)), "r3", 3, _words)
    assert early.take([4, 5, 6, 8], eos_ids=[9]) == [4, 5, 6, 8] and not early.finished  # "w4" in token 1 only


def test_features_the_verifier_does_not_apply_are_refused_naming_them():
    older = Limits(vocab_size=100, max_model_len=64, sampling_features=frozenset({"min_tokens"}))
    with pytest.raises(RequestError) as err:
        validate(GenerationRequest("p", (1,), 4, SamplingParams(1.0, min_p=0.1, min_tokens=2)), older)
    assert err.value.message.startswith("min_p is not applied by this server's verifier") and "leave min_p out" in err.value.message
    validate(GenerationRequest("t", (1,), 4, SamplingParams(min_tokens=2)), older)
    validate(GenerationRequest("g", (1,), 4, SamplingParams(0.0, min_p=0.1)), older)  # greedy: min_p changes nothing
    validate(GenerationRequest("a", (1,), 4, SamplingParams(1.0, min_p=0.1)), LIMITS)  # None: an in-process engine


def test_the_scheduler_s_min_tokens_stop_ids_are_eos_unless_ignored_and_the_stop_ids():
    req = GenerationRequest("m", (1,), 10, SamplingParams(min_tokens=3), stop_token_ids=(7, 5))
    assert with_min_tokens_stops(req, (9, 2)).params.min_tokens_stop_ids == (2, 5, 7, 9)
    ignored = GenerationRequest("i", (1,), 10, SamplingParams(min_tokens=3), ignore_eos=True, stop_token_ids=(7,))
    assert with_min_tokens_stops(ignored, (9,)).params.min_tokens_stop_ids == (7,)
    plain = GenerationRequest("p", (1,), 10, stop_token_ids=(7,))
    assert with_min_tokens_stops(plain, (9,)) is plain


def test_usage_and_per_position_acceptance_counted_once():
    req = Request(GenerationRequest("r", (1, 2), 10), "r1", 1)
    req.count_drafts(3, 2)
    req.count_drafts(3, 0)
    req.count_drafts(0, 0)  # a step without drafts
    req.count_drafts(4, 4)
    req.take([5, 6], eos_ids=())
    assert req.usage() == {"prompt_tokens": 2, "completion_tokens": 2, "proposed_draft_tokens": 10,
                           "accepted_draft_tokens": 6, "accepted_per_position": [2, 2, 1, 1]}
    assert req.speculative_steps == 3


def test_resume_prompt_is_prompt_plus_output():
    req = Request(GenerationRequest("r", (1, 2), 10), "r1", 1)
    req.take([7, 8], eos_ids=())
    assert req.seq_add().prompt_token_ids == (1, 2, 7, 8) and req.num_tokens == 4 and req.budget == 8


def test_finish_wins_once_across_threads():
    events = []
    req = Request(GenerationRequest("r", (1,), 10), "r1", 1, sink=events.append)
    wins = []
    threads = [threading.Thread(target=lambda: wins.append(req.finish("abort"))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    req.emit([3])  # after the end: dropped
    assert wins.count(True) == 1 and len(events) == 1 and events[0].finish_reason == "abort"


def test_logprobs_zero_and_twenty_are_valid():
    for n in (None, 0, 20):
        validate(GenerationRequest("r", (1, 2), 4, logprobs=n), LIMITS)


def _lp(t: int) -> TokenLogprob:
    return TokenLogprob(t, -float(t), ((t, -float(t)),))


def test_events_carry_their_tokens_logprobs_cut_like_the_tokens():
    events = []
    req = Request(GenerationRequest("r", (1,), 5, logprobs=1), "r1", 1, sink=events.append)
    assert req.seq_add().logprobs == 1
    req.emit(req.take([2, 3], eos_ids=(), logprobs=[_lp(2), _lp(3)]))
    kept = req.take([4, 5, 6, 7], eos_ids=(), logprobs=[_lp(t) for t in (4, 5, 6, 7)])  # max_tokens cuts at 3
    assert kept == [4, 5, 6] and req.finish_reason == "length"
    req.finish(tokens=kept)
    assert [e.token_ids for e in events] == [[2, 3], [4, 5, 6]]
    assert [e.logprobs for e in events] == [[_lp(2), _lp(3)], [_lp(4), _lp(5), _lp(6)]]
    assert req.logprobs == [_lp(t) for t in (2, 3, 4, 5, 6)]
    eos = Request(GenerationRequest("e", (1,), 9, logprobs=0), "r2", 2)
    assert eos.take([3, 9, 4], eos_ids=[9], logprobs=[_lp(3), _lp(9), _lp(4)]) == [3, 9]
    assert eos.logprobs == [_lp(3), _lp(9)]


def test_events_without_logprobs_carry_none():
    events = []
    req = Request(GenerationRequest("r", (1,), 5), "r1", 1, sink=events.append)
    assert req.seq_add().logprobs is None and req.logprobs is None
    req.emit(req.take([2], eos_ids=()))
    req.finish("abort")
    assert [e.logprobs for e in events] == [None, None]


def test_each_event_carries_its_steps_draft_counts():
    """Per event: the drafts of the step(s) since the last event (a step that kept no token is
    counted with the next event), so the events add up to usage."""
    events = []
    req = Request(GenerationRequest("r", (1,), 20), "r1", 1, sink=events.append)
    req.count_drafts(3, 2)
    req.emit(req.take([2, 3, 4], eos_ids=()))
    req.count_drafts(4, 0)  # a step that kept nothing (abandoned): no event
    req.count_drafts(2, 1)
    req.emit(req.take([5, 6], eos_ids=()))
    req.count_drafts(0, 0)
    req.emit(req.take([7], eos_ids=()))
    req.count_drafts(3, 3)
    req.finish("length", req.take([8, 9, 10, 11], eos_ids=()))
    assert [(e.proposed, e.accepted) for e in events] == [(3, 2), (6, 1), (0, 0), (3, 3)]
    usage = events[-1].usage
    assert sum(e.proposed for e in events) == usage["proposed_draft_tokens"] == 12
    assert sum(e.accepted for e in events) == usage["accepted_draft_tokens"] == 6


def test_resume_after_preemption_asks_for_logprobs_again():
    req = Request(GenerationRequest("r", (1, 2), 10, logprobs=4), "r1", 1)
    req.take([7], eos_ids=(), logprobs=[_lp(7)])
    req.seq_id = "r1.1"
    add = req.seq_add()
    assert add.prompt_token_ids == (1, 2, 7) and add.logprobs == 4 and add.seq_id == "r1.1"
