"""Asynchronous pre-drafting (SpecDecoder with SpecConfig.async_draft): the drafter drafts the
branch "every draft accepted + its bonus guess" while the verifier verifies, on its own thread.

Greedy output equals target-only (up to certified near-ties) whether branches hit or miss; hits
are forced with the target as its own draft, misses with a far draft. Sampled output keeps the
target's distribution (chi-square and TV on the joint of four tokens). A drafter that fails in
the middle of a pre-draft costs speed, never tokens."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from specsplit.config import EngineConfig, SpecConfig
from specsplit.request import RequestError
from specsplit.factory import build_colocated
from specsplit.request import GenerationRequest
from specsplit.scheduler import Scheduler
from specsplit.sampling import logits_to_probs
from specsplit.sampling.params import SamplingParams
from tests.helpers.chisquare import joint_fit
from tests.helpers.drafters import DrafterWrapper, FailsAhead
from tests.helpers.greedy import assert_greedy_equal_or_tie
from tests.unit.test_spec_greedy_equality import MAX_LEN, _requests


def _colo(target, draft, k, max_num_seqs=16, async_draft=True, max_len=MAX_LEN):
    tc = EngineConfig(model=str(target), max_model_len=max_len, max_num_seqs=max_num_seqs)
    dc = None if draft is None else EngineConfig(model=str(draft), max_model_len=max_len, max_num_seqs=max_num_seqs)
    return build_colocated(tc, dc, SpecConfig(num_speculative_tokens=k, async_draft=async_draft), show_progress=False)


def _assert_released(colo):
    for engine in (colo.target, colo.drafter):
        bm = engine.block_manager
        assert engine.num_running == 0 and bm.num_free_blocks == bm.num_blocks, "KV blocks leaked"
    assert colo.drafter.num_q_rows == 0 and not colo.decoder.predraft.ready


@pytest.fixture(scope="module")
def reference(tiny_llama):
    cache = {}

    def get(batch):
        if batch not in cache:
            colo = _colo(tiny_llama, None, 0)
            cache[batch] = [s.output for s in Scheduler(colo.decoder, colo.eos_token_ids, 16).run(_requests(batch, seed=batch))]
            colo.close()
        return cache[batch]

    return get


@pytest.mark.parametrize("batch", [1, 4, 16])
@pytest.mark.parametrize("draft,k", [("tiny_llama", 3), ("tiny_draft_close", 2), ("tiny_draft_far", 4)])
def test_async_greedy_equal(request, tiny_llama, tiny_llama_logits, reference, draft, k, batch):
    colo = _colo(tiny_llama, request.getfixturevalue(draft), k)
    dec = colo.decoder
    states = Scheduler(dec, colo.eos_token_ids, 16).run(_requests(batch, seed=batch))
    for req, s, ref in zip(_requests(batch, seed=batch), states, reference(batch)):
        assert_greedy_equal_or_tie(ref, tiny_llama_logits, s.output, prompt=req.prompt_token_ids)
    assert len(states) == batch
    if draft == "tiny_llama":  # the target as its own draft: every branch comes true (but ties)
        assert dec.branch_hits > 0 and dec.branch_hits >= 4 * dec.branch_misses, (dec.branch_hits, dec.branch_misses)
    if draft == "tiny_draft_far":
        assert dec.branch_misses > dec.branch_hits
    _assert_released(colo)
    colo.close()


def test_lockstep_and_async_emit_the_same_tokens(tiny_llama, tiny_draft_close):
    """Same engines, same requests: pre-drafting changes when drafts are made, not what is emitted."""
    outs = []
    for async_draft in (False, True):
        colo = _colo(tiny_llama, tiny_draft_close, 3, async_draft=async_draft)
        outs.append([s.output for s in Scheduler(colo.decoder, colo.eos_token_ids, 16).run(_requests(6, seed=3))])
        colo.close()
    assert outs[0] == outs[1]


def test_sampled_async_equals_lockstep_token_for_token(tiny_llama, tiny_draft_close):
    """Random numbers are keyed by position (specsplit/sampling/rng.py), so a branch's drafts are
    the very drafts lockstep would draw at the next step: rejection sampling (no coupling) emits
    the same tokens for the same seed with or without pre-drafting, hits and misses alike. (This
    caught a q row fetched at the wrong chain position after a hit.)"""
    outs, hits = [], 0
    for async_draft in (False, True):
        colo = _colo(tiny_llama, tiny_draft_close, 2, max_num_seqs=4, max_len=64, async_draft=async_draft)
        reqs = [GenerationRequest(f"r{i}", (5, 6, 7, 8, 9, 5, 6, 7), 6,
                                  SamplingParams(seed=i, coupling=False, temperature=1.0, top_k=3), ignore_eos=True)
                for i in range(120)]
        outs.append([s.output for s in Scheduler(colo.decoder, colo.eos_token_ids, 4).run(reqs)])
        hits = colo.decoder.branch_hits
        colo.close()
    assert hits > 20 and outs[0] == outs[1]


def test_drafter_lost_mid_pre_draft_keeps_greedy_output(tiny_llama, tiny_draft_close, tiny_llama_logits, reference):
    colo = _colo(tiny_llama, tiny_draft_close, 3)
    flaky = FailsAhead(colo.drafter)
    colo.decoder.drafter = flaky
    colo.decoder.drafter_retry_s = 0.0  # re-sync at once, so pre-drafts keep failing and recovering
    states = Scheduler(colo.decoder, colo.eos_token_ids, 16).run(_requests(4, seed=4))
    for req, s, ref in zip(_requests(4, seed=4), states, reference(4)):
        assert_greedy_equal_or_tie(ref, tiny_llama_logits, s.output, prompt=req.prompt_token_ids)
    assert flaky.failures >= 2 and sum(s.proposed for s in states) > 0
    _assert_released(colo)
    colo.close()


class OneCallAtATime(DrafterWrapper):
    """Slow pre-drafts, and a count of calls that found another still inside: a drafter client is
    single-threaded, so there must never be one."""

    def __init__(self, engine):
        super().__init__(engine)
        self.inside = 0
        self.overlaps = 0
        self.pre_drafts = 0
        self._lock = threading.Lock()

    def _call(self, fn, *args, slow=False, **kw):
        with self._lock:
            self.overlaps += self.inside > 0
            self.inside += 1
        try:
            if slow:
                time.sleep(0.2)  # the verify raises while this is still out
            return fn(*args, **kw)
        finally:
            with self._lock:
                self.inside -= 1

    def add(self, seqs):
        return self._call(self.engine.add, seqs)

    def propose(self, reqs):
        pre = any(r.pre_draft for r in reqs)
        self.pre_drafts += pre
        return self._call(self.engine.propose, reqs, slow=pre)

    def fetch_rows(self, fetch):
        return self._call(self.engine.fetch_rows, fetch)

    def release(self, ids, finished=False):
        return self._call(self.engine.release, ids, finished=finished)


class FailsOnVerify:
    """The real target engine, whose verify raises from its `at`-th call on (a verifier lost)."""

    def __init__(self, engine, at: int):
        self.engine, self.at, self.calls = engine, at, 0

    def verify(self, reqs):
        self.calls += 1
        if self.calls >= self.at:
            raise ConnectionError("verifier lost")
        return self.engine.verify(reqs)

    def __getattr__(self, name):
        return getattr(self.engine, name)


def test_a_verify_that_raises_waits_for_the_pre_draft_call(tiny_llama, tiny_draft_close):
    """Issue #24 finding 10: the pre-draft call runs on the drafter's one client while the target
    verifies; when the verify raises, the step waits for that call before the failure is handled
    (the scheduler then releases every sequence on the drafter): never two calls at once."""
    colo = _colo(tiny_llama, tiny_draft_close, 3)
    drafter = OneCallAtATime(colo.drafter)
    colo.decoder.drafter = drafter
    colo.decoder.verifier = FailsOnVerify(colo.target, at=4)
    with pytest.raises(RequestError, match="verifier lost"):  # every request ends with the error
        Scheduler(colo.decoder, colo.eos_token_ids, 16).run(_requests(4, seed=4))
    assert drafter.pre_drafts > 0, "no pre-draft was in flight when the verify raised"
    assert drafter.overlaps == 0
    colo.close()


# ---- sampling ------------------------------------------------------------------------------
PROMPT = (5, 6, 7, 8, 9, 5, 6, 7)
PARAMS = dict(temperature=1.0, top_k=3)  # three tokens per position: 81 cells for four tokens
NUM_SAMPLES = 3000
NEW_TOKENS = 4


def _joint(target_dir) -> dict[tuple[int, ...], float]:
    """The target's probability of every NEW_TOKENS continuation of PROMPT (under PARAMS)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    out = {(): 1.0}
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            nxt = {}
            for prefix, p in out.items():
                logits = model(torch.tensor([PROMPT + prefix])).logits[0, -1:]
                row = logits_to_probs(logits, torch.tensor([PARAMS["temperature"]]), torch.tensor([PARAMS["top_k"]]),
                                      torch.tensor([1.0]))[0]  # [V]
                for t in torch.nonzero(row).flatten().tolist():
                    nxt[prefix + (t,)] = p * float(row[t])
            out = nxt
    return out


@pytest.mark.slow
@pytest.mark.parametrize("flaky", [False, True], ids=["async", "async-lossy"])
def test_async_sampling_keeps_the_target_distribution(tiny_llama, tiny_draft_close, flaky):
    """Rejection sampling (no coupling) with pre-drafted branches; with `flaky` half the pre-drafts
    fail, so steps also take the exact fallback (Verifier.abandon)."""
    colo = _colo(tiny_llama, tiny_draft_close, 1, max_num_seqs=8, max_len=64)
    if flaky:
        colo.decoder.drafter = FailsAhead(colo.drafter)
        colo.decoder.drafter_retry_s = 0.0
    gen = Scheduler(colo.decoder, colo.eos_token_ids, 8)
    reqs = [GenerationRequest(f"r{i}", PROMPT, NEW_TOKENS, SamplingParams(seed=i, coupling=False, **PARAMS),
                              ignore_eos=True) for i in range(NUM_SAMPLES)]
    states = gen.run(reqs)
    dec = colo.decoder
    assert dec.branch_hits > 100 and dec.branch_misses > 100, (dec.branch_hits, dec.branch_misses)

    pvalue, tv = joint_fit([s.output for s in states], _joint(tiny_llama))
    print(f"FIGURE async sampling ({'lossy' if flaky else 'clean'}): joint of {NEW_TOKENS} tokens chi-square p "
          f"{pvalue:.3g}, TV {tv:.4f}; branch hits {dec.branch_hits}, misses {dec.branch_misses}")
    # TV of an exact sampler with 3000 draws over <= 81 cells is ~0.06-0.08 (sampling noise).
    assert pvalue > 1e-3 and tv < 0.12, (pvalue, tv)
    _assert_released(colo)
    colo.close()
