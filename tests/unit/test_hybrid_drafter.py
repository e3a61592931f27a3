"""`--draft MODEL+ngram` (specsplit/hybrid_drafter.py): greedy output is the target's token for
token, both proposers actually draft, sampled requests stay on the model, nothing leaks."""
from __future__ import annotations

import pytest

from specsplit.config import EngineConfig, SpecConfig
from specsplit.factory import build_colocated, build_draft_engine
from specsplit.request import GenerationRequest
from specsplit.scheduler import Scheduler
from specsplit.hybrid_drafter import HybridDrafter
from specsplit.models.registry import split_draft_name
from specsplit.sampling.params import SamplingParams
from tests.unit.test_spec_greedy_equality import MAX_LEN, _requests
from tests.helpers.greedy import assert_outputs_equal_or_tie


def _colo(target, draft, k, max_num_seqs=16, lookup="ngram"):
    tc = EngineConfig(model=str(target), max_model_len=MAX_LEN, max_num_seqs=max_num_seqs)
    dc = EngineConfig(model=f"{draft}+{lookup}", max_model_len=MAX_LEN, max_num_seqs=max_num_seqs)
    return build_colocated(tc, dc, SpecConfig(num_speculative_tokens=k), show_progress=False)


def _target_only(target, requests):
    tc = EngineConfig(model=str(target), max_model_len=MAX_LEN, max_num_seqs=16)
    colo = build_colocated(tc, None, SpecConfig(num_speculative_tokens=0), show_progress=False)
    return [s.output for s in Scheduler(colo.decoder, colo.eos_token_ids, 16).run(requests)]


def test_split_draft_name():
    assert split_draft_name("smollm2-135m-draft+ngram") == ("smollm2-135m-draft", "ngram")
    assert split_draft_name("/models/d+ngram") == ("/models/d", "ngram")
    assert split_draft_name("smollm2-135m-draft+suffix") == ("smollm2-135m-draft", "suffix")
    assert split_draft_name("ngram") == ("ngram", None)
    assert split_draft_name("suffix") == ("suffix", None)
    assert split_draft_name("+ngram") == ("+ngram", None)
    assert split_draft_name("smollm2-135m-draft") == ("smollm2-135m-draft", None)


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("draft", ["tiny_draft_close", "tiny_draft_far"])
def test_hybrid_greedy_equals_target_only(request, tiny_llama, tiny_llama_logits, draft, k, batch):
    requests = _requests(batch, seed=batch + 10)
    colo = _colo(tiny_llama, request.getfixturevalue(draft), k)
    assert isinstance(colo.drafter, HybridDrafter)
    states = Scheduler(colo.decoder, colo.eos_token_ids, 16).run(requests)
    assert_outputs_equal_or_tie(_target_only(tiny_llama, requests), [s.output for s in states],
                                [r.prompt_token_ids for r in requests], tiny_llama_logits)
    # Repetitive prompts: lookup drafts some steps, the model the others.
    assert colo.drafter.lookup_steps > 0 and colo.drafter.model_steps > 0
    assert sum(s.proposed for s in states) > 0
    for bm in (colo.target.block_manager, colo.drafter.block_manager):
        assert bm.num_free_blocks == bm.num_blocks, "KV blocks leaked"
    assert colo.drafter.tokens == {} and colo.drafter.num_running == 0


def test_sampled_requests_use_the_model_and_stay_seeded(tiny_llama, tiny_draft_close):
    colo = _colo(tiny_llama, tiny_draft_close, 3, max_num_seqs=8)
    gen = Scheduler(colo.decoder, colo.eos_token_ids, 8)

    def req(rid, seed):
        # rejection sampling needs the model's q rows (coupled seeded requests may use lookup:
        # tests/unit/sampling/test_sampling_coupled.py)
        return GenerationRequest(rid, (5, 6, 7, 8, 9, 5, 6, 7), 24, SamplingParams(0.8, 1.0, 0, seed, coupling=False),
                                 ignore_eos=True)

    (alone,) = gen.run([req("a", 7)])
    batch = gen.run([req("b", 1), req("a", 7)])
    assert alone.output == batch[1].output and alone.proposed > 0
    assert colo.drafter.lookup_steps == 0  # never prompt lookup for a sampled request
    assert colo.drafter.model.num_q_rows == 0


def test_drafter_service_engine_is_hybrid(tiny_llama):
    cfg = EngineConfig(model=f"{tiny_llama}+ngram", max_model_len=MAX_LEN, max_num_seqs=4)
    engine, plan = build_draft_engine(cfg, SpecConfig(num_speculative_tokens=3))
    assert isinstance(engine, HybridDrafter)
    assert plan.services["drafter"].model == str(tiny_llama)  # the plan is the model's: lookup needs no memory
    assert engine.runner is engine.model.runner and engine.vocab_size == engine.model.vocab_size


@pytest.mark.parametrize("model_tokens,expected", [(1, 1), (2, 2), (0, 3)])
def test_model_drafts_at_most_model_tokens_lookup_up_to_k(tiny_llama, model_tokens, expected):
    from specsplit.protocols import ProposeRequest, SeqAdd

    cfg = EngineConfig(model=f"{tiny_llama}+ngram", max_model_len=MAX_LEN, max_num_seqs=4)
    engine, _ = build_draft_engine(cfg, SpecConfig(num_speculative_tokens=3, draft_model_tokens=model_tokens))
    engine.add([SeqAdd("fresh", (10, 11, 12, 13)), SeqAdd("repeats", (7, 8, 9, 10, 7, 8, 9, 10, 7))])
    fresh, repeats = engine.propose([ProposeRequest("fresh", (), 3), ProposeRequest("repeats", (), 3)])
    assert len(fresh.token_ids) == expected  # no earlier occurrence of 13: the model drafts
    assert repeats.token_ids == (8, 9, 10)  # '7' occurred before: lookup drafts the full K
    assert engine.lookup_steps == 1 and engine.model_steps == 1
    engine.release(["fresh", "repeats"])
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def _short_and_long_match(hybrid: HybridDrafter) -> None:
    """Two sequences before a feature drafter: "short" ends in a 1-token match ('9' occurred before,
    then 50 51 9; '51 9' did not), "long" in a 3-token one ('41 42 9': 50 41 42 follow it). The
    long match is looked up; past the short one the head drafts."""
    import torch

    from specsplit.protocols import ProposeRequest, SeqAdd

    hybrid.add([SeqAdd("short", (40, 41, 42, 9, 50, 51, 9)), SeqAdd("long", (40, 41, 42, 9, 50, 41, 42, 9))])
    feats = torch.randn(8, hybrid.model.feature_size)
    a, b = hybrid.propose([ProposeRequest("short", (), 3, features=feats[:7], features_start=0),
                           ProposeRequest("long", (), 3, features=feats, features_start=0)])
    assert b.token_ids == (50, 41, 42) and hybrid.lookup_steps == 1
    assert hybrid.model_steps == 1 and len(a.token_ids) == 3


def test_before_an_eagle3_head_lookup_needs_a_longer_match(tiny_llama, tmp_path):
    """MODEL+ngram over a feature drafter: a match shorter than FEATURE_NGRAM_MIN tokens leaves the
    drafting to the head; a longer one is still looked up. The small draft model keeps 1."""
    import torch

    from specsplit.hybrid_drafter import FEATURE_NGRAM_MIN
    from tests.helpers.eagle3 import write_tiny_head

    head = write_tiny_head(tmp_path / "head", torch.arange(3, 200))
    colo = _colo(tiny_llama, head, 3)
    try:
        hybrid = colo.drafter
        assert isinstance(hybrid, HybridDrafter) and hybrid.ngram_min == FEATURE_NGRAM_MIN == 3
        _short_and_long_match(hybrid)
        hybrid.release(["short", "long"])
    finally:
        colo.close()
    small = _colo(tiny_llama, tiny_llama, 3)
    try:
        assert small.drafter.ngram_min == 1
    finally:
        small.close()


def test_before_an_eagle3_head_a_suffix_match_needs_the_longer_match_too(tiny_llama, tmp_path):
    """MODEL+suffix over a feature drafter: the suffix drafter's match must be FEATURE_NGRAM_MIN
    tokens long as prompt lookup's is; a shorter one leaves the drafting to the head, however
    sure its continuation counts make it (a 1-token match seen once reads as certain). Measured:
    SmolLM2-135M + the shipped head on plain chat, 862 -> 764 steps for the same tokens (+ngram:
    773), and fewer on repeated answers too (docs/suffix-drafter.md)."""
    import torch

    from tests.helpers.eagle3 import write_tiny_head

    head = write_tiny_head(tmp_path / "head", torch.arange(3, 200))
    colo = _colo(tiny_llama, head, 3, lookup="suffix")
    try:
        hybrid = colo.drafter
        assert isinstance(hybrid, HybridDrafter) and hybrid.suffix is not None and hybrid.ngram_min == 3
        _short_and_long_match(hybrid)
        assert hybrid.suffix.draft("short", 3)[0] == [50, 51, 9]  # the suffix drafter alone would have
        hybrid.release(["short", "long"])
    finally:
        colo.close()

