"""A drafter's bad answer never reaches the verifier: the proposal is dropped (that sequence decodes
target-only for the step) and unusable q rows abandon the step; no stream fails, and the other
sequences go on speculating."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from specsplit.config import EngineConfig, SpecConfig
from specsplit.factory import build_colocated
from specsplit.request import GenerationRequest
from specsplit.scheduler import Scheduler
from specsplit.sampling.params import SamplingParams
from specsplit.protocols import DrafterTraits, VerifierTraits
from tests.helpers.greedy import assert_outputs_equal_or_tie

VOCAB = 256

CORRUPT = {
    "one draft too many": lambda p: dataclasses.replace(p, token_ids=p.token_ids + (7,),
                                                        probs=None if p.probs is None else p.probs + (0.5,)),
    "id past the vocabulary": lambda p: dataclasses.replace(p, token_ids=(VOCAB,) + p.token_ids[1:]),
    "negative id": lambda p: dataclasses.replace(p, token_ids=(-1,) + p.token_ids[1:]),
    "q(x) NaN": lambda p: dataclasses.replace(p, probs=(math.nan,) + p.probs[1:]),
    "q(x) 0": lambda p: dataclasses.replace(p, probs=(0.0,) + p.probs[1:]),
    "q(x) above 1": lambda p: dataclasses.replace(p, probs=(1.5,) + p.probs[1:]),
    "q(x) inf": lambda p: dataclasses.replace(p, probs=(math.inf,) + p.probs[1:]),
    "no q(x)": lambda p: dataclasses.replace(p, probs=None),
    "q(x) count": lambda p: dataclasses.replace(p, probs=p.probs[:-1]),
}


def _is_victim(seq) -> bool:
    """The victim-* requests of _requests(), as the engines see them: the scheduler gives engines
    short ids (r<n>), so they are told apart by what they carry (victim-s: seed 3; victim-g: its prompt)."""
    return seq.params.seed == 3 or tuple(seq.prompt_token_ids[:3]) == (9, 10, 11)


class BadDrafter(DrafterTraits):
    """A real draft engine whose answers for the victim sequences are corrupted."""

    def __init__(self, engine, corrupt=None, bad_rows: bool = False):
        self.engine, self.corrupt, self.bad_rows = engine, corrupt, bad_rows
        self.corrupted = 0
        self.victims: set[str] = set()

    def add(self, seqs):
        self.victims |= {s.seq_id for s in seqs if _is_victim(s)}
        return self.engine.add(seqs)

    def propose(self, reqs):
        out = self.engine.propose(reqs)
        if self.corrupt is None:
            return out
        bad = [self.corrupt(p) if p.seq_id in self.victims and p.token_ids else p for p in out]
        self.corrupted += sum(a is not b for a, b in zip(bad, out))
        return bad

    def fetch_rows(self, fetch):
        rows = self.engine.fetch_rows(fetch)
        if self.bad_rows:
            for r in rows:
                if r.seq_id in self.victims:
                    r.row = torch.full_like(r.row, math.nan)
                    self.corrupted += 1
        return rows

    def release(self, ids, finished=False):
        return self.engine.release(ids, finished=finished)


class CheckedVerifier(VerifierTraits):
    """The real target engine, asserting that every proposal it is asked to verify is sound."""

    def __init__(self, engine, k: int):
        self.engine, self.k = engine, k
        self.vocab_size = engine.vocab_size

    def verify(self, reqs):
        for r in reqs:
            assert len(r.draft_token_ids) <= self.k, r
            assert all(0 <= t < VOCAB for t in r.draft_token_ids), r
            if r.draft_probs is not None:
                assert len(r.draft_probs) == len(r.draft_token_ids), r
                assert all(math.isfinite(q) and 0 < q <= 1 for q in r.draft_probs), r
        return self.engine.verify(reqs)

    def resolve(self, rows):
        for r in rows:
            assert bool(torch.isfinite(r.row).all()) and bool((r.row >= 0).all()), r.seq_id
        return self.engine.resolve(rows)

    def __getattr__(self, name):
        return getattr(self.engine, name)


def _requests():
    sampled = SamplingParams(temperature=1.0, seed=3, coupling=False)  # rejection sampling: q(x) and q rows
    return [GenerationRequest("victim-s", (5, 6, 7, 8), 20, sampled, ignore_eos=True),
            GenerationRequest("victim-g", (9, 10, 11), 20, ignore_eos=True),
            GenerationRequest("ok-s", (5, 6, 7, 8), 20, SamplingParams(temperature=1.0, seed=4, coupling=False), ignore_eos=True),
            GenerationRequest("ok-g", (12, 13, 14, 15), 20, ignore_eos=True)]


def _run(tiny_llama, tiny_draft, drafter_wrap, audit_rate=None):
    tc = EngineConfig(model=str(tiny_llama), max_model_len=64, max_num_seqs=4)
    dc = EngineConfig(model=str(tiny_draft), max_model_len=64, max_num_seqs=4)
    colo = build_colocated(tc, dc, SpecConfig(num_speculative_tokens=3, disable_by_batch_size=0), show_progress=False)
    wrapped = drafter_wrap(colo.drafter)
    colo.decoder.drafter = wrapped
    colo.decoder.verifier = CheckedVerifier(colo.target, 3)
    colo.decoder.drafter_retry_s = 0.0  # a drafter marked failed is retried at once
    if audit_rate is not None:
        colo.decoder.q_audit_rate = audit_rate
    states = {s.request.request_id: s for s in Scheduler(colo.decoder, colo.eos_token_ids, 4).run(_requests())}
    return colo, wrapped, states


class _Reference(dict):
    """request id -> the target alone's greedy output; next_logits certifies a near-tie."""

    next_logits = None


@pytest.fixture(scope="module")
def reference(tiny_llama, tiny_llama_logits):
    tc = EngineConfig(model=str(tiny_llama), max_model_len=64, max_num_seqs=4)
    colo = build_colocated(tc, None, SpecConfig(num_speculative_tokens=0), show_progress=False)
    states = Scheduler(colo.decoder, colo.eos_token_ids, 4).run([r for r in _requests() if r.params.greedy])
    ref = _Reference({s.request.request_id: s.output for s in states})
    ref.next_logits = tiny_llama_logits
    yield ref
    colo.close()


def _check(colo, wrapped, states, reference):
    assert wrapped.corrupted > 0
    assert all(s.finished and len(s.output) == 20 for s in states.values())
    prompts = {r.request_id: r.prompt_token_ids for r in _requests()}
    ids = list(reference)  # greedy output is still the target's (up to a certified near-tie)
    assert_outputs_equal_or_tie([reference[r] for r in ids], [states[r].output for r in ids], [prompts[r] for r in ids],
                                reference.next_logits)
    assert states["ok-s"].proposed > 0 and states["ok-g"].proposed > 0  # the others kept speculating
    assert colo.target.num_running == 0 and colo.drafter.num_running == 0
    for bm in (colo.target.block_manager, colo.drafter.block_manager):
        assert bm.num_free_blocks == bm.num_blocks
    colo.close()


@pytest.mark.parametrize("case", list(CORRUPT))
def test_bad_proposals_fall_back_to_target_only(tiny_llama, tiny_draft_close, reference, case):
    corrupt = CORRUPT[case]
    if case.startswith("q(x)") or case == "no q(x)":  # only sampled sequences carry q(x)
        corrupt = lambda p: CORRUPT[case](p) if p.probs is not None else p  # noqa: E731

    def wrap(engine):
        return BadDrafter(engine, corrupt)

    _check(*_run(tiny_llama, tiny_draft_close, wrap), reference)


def test_unusable_q_rows_abandon_the_step(tiny_llama, tiny_draft_far, reference):
    """NaN q rows from fetch_rows: the sampled sequences discard the step; nothing fails."""
    _check(*_run(tiny_llama, tiny_draft_far, lambda engine: BadDrafter(engine, bad_rows=True)), reference)


@pytest.mark.parametrize("tree_nodes, tokens, parents, why", [
    (2, (5, 6, 7, 8), (-1, 0, 1, 0), None),  # a chain of 3 and one leaf
    (0, (5, 6, 7, 8), (-1, 0, 1, 0), "a chain was asked for"),
    (2, (5, 6, 7), (-1, 2, 0), "bad tree"),  # a child before its parent
    (2, (5, 6, 7), (-1, 0), "bad tree"),  # a parent count that is not the node count
    (1, (5, 6, 7, 8, 9), (-1, 0, 1, 0, -1), "branch nodes"),  # k + 2 nodes, 1 asked
    (4, (5, 6, 7, 8), (-1, 0, 1, 2), "branch nodes"),  # 4 deep, k = 3
])
def test_tree_proposals_are_checked(tree_nodes, tokens, parents, why):
    from specsplit.protocols import Proposal, ProposeRequest, SeqAdd
    from specsplit.spec.peer_checks import proposal_problem
    from specsplit.spec.track import Track

    tracks = {"a": Track(add=SeqAdd("a", (1, 2)), k=3, tokens=[1, 2])}
    got = proposal_problem(Proposal("a", tokens, None, parents), {"a": ProposeRequest("a", (), 3, tree_nodes=tree_nodes)},
                           VOCAB, tracks)
    assert (got is None) if why is None else (why in got), got


def test_q_claims_that_disagree_with_the_q_row_abandon_the_step(tiny_llama, tiny_draft_far, reference, caplog):
    """A drafter that claims more q(x) than its distribution gives (0.999 for every draft of the
    victim) is rejected more often; at the first rejection its q row shows the claim false: the
    step is abandoned (exact), the drafter is treated as failed and retried; nothing fails."""
    over = lambda p: dataclasses.replace(p, probs=tuple(0.999 for _ in p.probs)) if p.probs is not None else p  # noqa: E731
    with caplog.at_level("WARNING"):
        _check(*_run(tiny_llama, tiny_draft_far, lambda engine: BadDrafter(engine, over)), reference)
    assert "its q row says" in caplog.text


def test_claims_problem_compares_q_x_with_the_row():
    from specsplit.protocols import Proposal, QRow
    from specsplit.spec.peer_checks import claims_problem

    row = torch.tensor([1.0, 3.0, 4.0, 0.0])  # sent unnormalized: q = 0.125, 0.375, 0.5, 0
    assert claims_problem({"a": 1}, [QRow("a", row)], {"a": Proposal("a", (2, 1), (0.5, 0.375))}) is None
    why = claims_problem({"a": 1}, [QRow("a", row)], {"a": Proposal("a", (2, 1), (0.5, 0.01))})
    assert why is not None and "0.01" in why and "0.375" in why


def test_audits_pick_sampled_chains_that_were_not_rejected():
    from specsplit.protocols import Proposal, VerifyResult
    from specsplit.spec.peer_checks import audit_positions

    proposals = {"s": Proposal("s", (4, 5, 6), (0.2, 0.3, 0.4)), "pending": Proposal("pending", (4, 5), (0.2, 0.3)),
                 "lookup": Proposal("lookup", (4, 5), (1.0, 1.0)), "greedy": Proposal("greedy", (4, 5)),
                 "none": Proposal("none", ())}
    results = [VerifyResult("s", 3, (4, 5, 6, 7)), VerifyResult("pending", 0, (), pending_position=0),
               VerifyResult("lookup", 2, (4, 5, 9)), VerifyResult("greedy", 2, (4, 5, 9)), VerifyResult("none", 0, (9,))]
    draws = iter([0.0, 0.99])  # audit it, at the last draft
    assert audit_positions(results, proposals, lambda: next(draws), rate=0.5) == {"s": 2}
    assert audit_positions(results, proposals, lambda: 0.7, rate=0.5) == {}


def test_tiny_q_claims_are_caught_by_the_audits(tiny_llama, tiny_draft_far, reference, caplog):
    """A drafter that claims far less q(x) than its distribution (1e-4 for every draft) has every
    draft accepted (p / q >= 1), so no rejection ever fetches its rows; the audits (every
    sequence-step here) fetch one accepted draft's row and find the claim false: the step is
    abandoned, the drafter treated as failed and retried; nothing fails."""
    tiny = lambda p: dataclasses.replace(p, probs=tuple(1e-4 for _ in p.probs)) if p.probs is not None else p  # noqa: E731

    def wrap(engine):
        return BadDrafter(engine, tiny)

    with caplog.at_level("WARNING"):
        colo, wrapped, states = _run(tiny_llama, tiny_draft_far, wrap, audit_rate=1.0)
        assert colo.decoder.q_audits > 0
        _check(colo, wrapped, states, reference)
    assert "its q row says" in caplog.text
