"""`--draft suffix` and `MODEL+suffix` (specsplit/suffix_drafter.py): drafts the most frequent
continuation of the longest earlier match, as far as the match is frequent; requests share only
finished outputs (never a live request's tokens, never with --suffix-share none); the cache is
bounded; greedy output is the target's, sampled requests stay seeded; nothing leaks."""
from __future__ import annotations

import numpy as np
import pytest

from specsplit.config import EngineConfig, SpecConfig
from specsplit.factory import build_colocated
from specsplit.hybrid_drafter import HybridDrafter
from specsplit.protocols import ProposeRequest, SeqAdd
from specsplit.request import GenerationRequest
from specsplit.sampling.params import SamplingParams
from specsplit.scheduler import Scheduler
from specsplit.suffix_drafter import SharedOutputs, SuffixDrafter, draft_from
from tests.helpers.greedy import assert_outputs_equal_or_tie
from tests.unit.test_spec_greedy_equality import MAX_LEN, _requests

ANSWER = (50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61)


def _propose(d: SuffixDrafter, seq_id: str, new=(), k: int = 8) -> tuple[int, ...]:
    (p,) = d.propose([ProposeRequest(seq_id, tuple(new), k)])
    assert p.probs == tuple(1.0 for _ in p.token_ids)  # deterministic drafts: q one-hot
    return p.token_ids


def test_most_frequent_continuation_and_length_from_frequency():
    # after (1, 2): 3 followed twice, 4 once -> 3 (share 2/3); after (1, 2, 3): 7 both times
    ctx = [1, 2, 3, 7, 9, 1, 2, 3, 7, 8, 1, 2, 4, 0, 1, 2]
    drafts, expected = draft_from([np.asarray(ctx)], ctx, 6, max_depth=8, min_prob=0.1)
    assert drafts[:2] == [3, 7]
    assert expected >= 2 / 3 + 2 / 3 - 1e-9  # the path probabilities summed: 2/3 after each of 3, 7
    # the path probability halves at (.., 7) -> {9, 8}; with min_prob 0.5 it stops there
    short, _ = draft_from([np.asarray(ctx)], ctx, 6, max_depth=8, min_prob=0.5)
    assert short == [3, 7]
    # nothing matched: no drafts
    assert draft_from([np.asarray(ctx)], ctx + [99], 6, 8, 0.1) == ([], 0.0)


def test_a_source_whose_match_is_shorter_than_min_match_drafts_nothing():
    # the context ends in (5, 6): matched earlier by 2 tokens (then 7), by 3 nowhere
    ctx = [1, 5, 6, 7, 2, 5, 6]
    assert draft_from([np.asarray(ctx)], ctx, 3, max_depth=8, min_prob=0.1, min_match=2)[0] == [7, 2, 5]
    assert draft_from([np.asarray(ctx)], ctx, 3, max_depth=8, min_prob=0.1, min_match=3) == ([], 0.0)
    # two sources: the one with the long enough match drafts
    other = np.asarray([9, 2, 5, 6, 8])
    assert draft_from([np.asarray(ctx), other], ctx, 1, max_depth=8, min_prob=0.1, min_match=3)[0] == [8]


def test_outputs_are_shared_only_once_finished():
    d = SuffixDrafter(vocab_size=100, max_model_len=256, share="finished")
    d.add([SeqAdd("a", (1, 2, 3)), SeqAdd("b", (4, 5, 6))])
    assert _propose(d, "a", ANSWER, k=0) == ()
    # a is live: its output never reaches b's drafts
    assert _propose(d, "b", ANSWER[:2]) == ()
    d.release(["a"], finished=True)
    assert _propose(d, "b", ANSWER[2:3]) == ANSWER[3:11]
    d.release(["b"])  # not finished (an abort): not added
    assert d.shared.outputs == 1 and d.num_running == 0


def test_an_aborted_or_preempted_request_is_not_shared_and_share_none_shares_nothing():
    for share, finished, expect in [("finished", False, ()), ("none", True, ())]:
        d = SuffixDrafter(share=share)
        d.add([SeqAdd("a", (1,))])
        _propose(d, "a", ANSWER, k=0)
        d.release(["a"], finished=finished)
        d.add([SeqAdd("b", (2,))])
        assert _propose(d, "b", ANSWER[:3]) == expect
        assert d.shared.num_tokens == 0


def test_shared_cache_is_bounded_oldest_first():
    shared = SharedOutputs(max_tokens=40)
    for i in range(10):
        shared.add([100 + i] * 9)
    assert shared.num_tokens <= 40 and shared.outputs == 4
    assert 100 not in shared.arr.tolist() and 109 in shared.arr.tolist()
    # the index of positions agrees with a scan of what is left after dropping the front
    rng = np.random.default_rng(0)
    shared = SharedOutputs(max_tokens=300)
    for _ in range(40):
        shared.add(rng.integers(0, 20, size=int(rng.integers(2, 30))).tolist())
        for t in range(20):
            assert shared.positions_of(t).tolist() == np.flatnonzero(shared.arr == t).tolist()
    ctx = shared.arr[-12:-6].tolist()
    assert draft_from([shared], ctx, 4, 8, 0.0) == draft_from([shared.arr], ctx, 4, 8, 0.0)
    with pytest.raises(ValueError, match="suffix-share"):
        SuffixDrafter(share="everyone")


def _colo(target, draft: str, k: int, max_num_seqs: int = 16, **spec):
    tc = EngineConfig(model=str(target), max_model_len=MAX_LEN, max_num_seqs=max_num_seqs)
    dc = EngineConfig(model=draft, max_model_len=MAX_LEN, max_num_seqs=max_num_seqs)
    return build_colocated(tc, dc, SpecConfig(num_speculative_tokens=k, **spec), show_progress=False)


def _target_only(target, requests):
    tc = EngineConfig(model=str(target), max_model_len=MAX_LEN, max_num_seqs=16)
    colo = build_colocated(tc, None, SpecConfig(num_speculative_tokens=0), show_progress=False)
    return [s.output for s in Scheduler(colo.decoder, colo.eos_token_ids, 16).run(requests)]


@pytest.mark.parametrize("hybrid", [False, True])
def test_greedy_equals_target_only_and_repeats_are_drafted_from_the_cache(request, tiny_llama, tiny_llama_logits,
                                                                         tiny_draft_close, hybrid):
    draft = f"{tiny_draft_close}+suffix" if hybrid else "suffix"
    k = 3 if hybrid else 6  # the tiny draft's cache holds K 3 at MAX_LEN
    colo = _colo(tiny_llama, draft, k)
    requests = _requests(6, seed=21, max_tokens=32)
    first = Scheduler(colo.decoder, colo.eos_token_ids, 16).run(requests)
    ref = _target_only(tiny_llama, requests)
    assert_outputs_equal_or_tie(ref, [s.output for s in first], [r.prompt_token_ids for r in requests], tiny_llama_logits)
    # The same prompts again (under new ids): their answers are in the shared cache now.
    again = [GenerationRequest(f"again-{r.request_id}", r.prompt_token_ids, r.max_tokens, ignore_eos=True)
             for r in requests]
    second = Scheduler(colo.decoder, colo.eos_token_ids, 16).run(again)
    assert [s.output for s in second] == [s.output for s in first]
    acc = sum(s.accepted for s in second) / max(1, sum(s.proposed for s in second))  # per drafted token
    # ... and most tokens came from accepted drafts (at most k of every k + 1 can)
    assert acc >= 0.8 and sum(s.accepted for s in second) > 0.8 * k / (k + 1) * sum(len(s.output) for s in second), acc
    suffix = colo.drafter.suffix if hybrid else colo.drafter
    assert isinstance(colo.drafter, HybridDrafter) == hybrid
    assert suffix.shared.outputs == 12 and suffix.num_running == 0
    if hybrid:
        assert colo.drafter.lookup_steps > 0 and colo.drafter.num_running == 0
        # the metric of drafts by source: what the verifier accepted of each, as the drafter saw it
        (lp, la), (mp, ma) = colo.drafter.judged["lookup"], colo.drafter.judged["model"]
        assert 0 < la <= lp and 0 <= ma <= mp and la + ma <= sum(s.accepted for s in first + second)
        assert colo.drafter.block_manager.num_free_blocks == colo.drafter.block_manager.num_blocks
    assert colo.target.block_manager.num_free_blocks == colo.target.block_manager.num_blocks


def test_sampled_requests_are_seeded_in_batch_or_alone(tiny_llama):
    # share none: each request's drafts depend on its own tokens only, so a seeded request's
    # output cannot depend on its batch (with sharing, drafts -- and so a sampled request's draws
    # -- also depend on what finished before; still the target's distribution: the rejection
    # sampler's tests cover one-hot q)
    colo = _colo(tiny_llama, "suffix", 4, max_num_seqs=8, suffix_share="none")

    def reqs(prefix):
        return [GenerationRequest(f"{prefix}{i}", tuple([7, 8, 9] * 4 + [i + 3]), 24, ignore_eos=True,
                                  params=SamplingParams(temperature=0.8, seed=100 + i, coupling=False))
                for i in range(4)]

    together = [s.output for s in Scheduler(colo.decoder, colo.eos_token_ids, 8).run(reqs("t"))]
    alone = [Scheduler(colo.decoder, colo.eos_token_ids, 8).run([r])[0].output for r in reqs("a")]
    assert together == alone and all(len(o) == 24 for o in together)
    assert colo.drafter.proposals > 0 and colo.drafter.num_running == 0


def test_the_drafter_service_plan_reports_the_cache_bound():
    from specsplit.factory import build_draft_engine

    cfg = EngineConfig(model="suffix", max_model_len=256)
    shared = build_draft_engine(cfg, SpecConfig(num_speculative_tokens=6, suffix_cache_tokens=1000))
    assert isinstance(shared.engine, SuffixDrafter) and shared.engine.shared.max_tokens == 1000
    assert shared.plan.services["drafter"].non_torch_bytes == 16_000
    assert "host memory up to" in shared.plan.log_lines()[0]
    alone = build_draft_engine(cfg, SpecConfig(num_speculative_tokens=6, suffix_share="none"))
    assert alone.plan.services["drafter"].non_torch_bytes == 0 and alone.engine.shared.max_tokens == 0


def test_one_default_cache_size_everywhere():
    from specsplit.defaults import DEFAULT_SUFFIX_CACHE_TOKENS, SUFFIX_SHARE_MODES

    assert SpecConfig().suffix_cache_tokens == DEFAULT_SUFFIX_CACHE_TOKENS == SuffixDrafter().shared.max_tokens
    assert SpecConfig().suffix_share in SUFFIX_SHARE_MODES


def test_a_tree_adds_the_second_heaviest_child_where_the_path_is_unsure():
    # after (1, 2): 3 twice, 4 once -> draft 3 (share 2/3), runner-up 4; after (1, 2, 3): 7 always
    # (none); after (.., 7): 8 and 9 once each -> 8 (the smaller id of a tie), runner-up 9
    ctx = [1, 2, 3, 7, 9, 1, 2, 3, 7, 8, 1, 2, 4, 0, 1, 2]
    alts: list = []
    drafts, _ = draft_from([np.asarray(ctx)], ctx, 3, max_depth=8, min_prob=0.1, alternatives=alts)
    assert drafts == [3, 7, 8] and alts == [(pytest.approx(2 / 3), 4), (1.0, -1), (0.5, 9)]
    d = SuffixDrafter(vocab_size=100, max_model_len=256, share="none")
    d.add([SeqAdd("a", tuple(ctx))])
    (tree,) = d.propose([ProposeRequest("a", (), 3, tree_nodes=2)])
    # the chain, then the leaves: 4 a sibling of 3, 9 a sibling of 8
    assert tree.token_ids == (3, 7, 8, 4, 9) and tree.parents == (-1, 0, 1, -1, 1)
    assert tree.probs == tuple(1.0 for _ in tree.token_ids)
    (chain,) = d.propose([ProposeRequest("a", (), 3)])
    assert chain.parents is None and chain.token_ids == (3, 7, 8)
