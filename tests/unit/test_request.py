"""The one Request (specsplit/request.py): validation in one place, stop rules with the detokenizer,
usage and per-position acceptance counted once, and a finish that wins exactly once."""
from __future__ import annotations

import threading

import pytest

from specsplit.request import GenerationRequest, Limits, Request, RequestError, validate
from specsplit.sampling.params import SamplingParams

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
