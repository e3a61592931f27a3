"""Seeded sampled requests are reproducible and independent of what they are batched with."""
from __future__ import annotations

import pytest

from specsplit.config import EngineConfig, SpecConfig
from specsplit.factory import build_colocated
from specsplit.request import GenerationRequest
from specsplit.scheduler import Scheduler
from specsplit.sampling.params import SamplingParams


def _gen(target, draft, k=3):
    tc = EngineConfig(model=str(target), max_model_len=128, max_num_seqs=8)
    dc = None if draft is None else EngineConfig(model=str(draft), max_model_len=128, max_num_seqs=8)
    colo = build_colocated(tc, dc, SpecConfig(num_speculative_tokens=k if dc else 0), show_progress=False)
    return colo, Scheduler(colo.decoder, colo.eos_token_ids, 8)


def _req(rid, seed, temperature=1.0, top_p=1.0, top_k=0):
    return GenerationRequest(rid, (5, 6, 7, 8, 9, 5, 6, 7), 24, SamplingParams(temperature, top_p, top_k, seed), ignore_eos=True)


@pytest.mark.parametrize("draft", ["tiny_draft_close", "ngram", None])
@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.7, top_k=20), dict(temperature=1.3, top_p=0.8)])
def test_seeded_reproducible_and_batch_independent(request, tiny_llama, draft, params):
    d = request.getfixturevalue(draft) if draft and draft != "ngram" else draft
    colo, gen = _gen(tiny_llama, d)
    (alone,) = gen.run([_req("a", 1234, **params)])
    (again,) = gen.run([_req("a", 1234, **params)])
    batch = gen.run([_req("b", 1, **params), _req("a", 1234, **params), _req("c", 99, **params)])
    assert alone.output == again.output == batch[1].output
    assert batch[0].output != batch[1].output  # different seeds differ (24 tokens of vocab 256)
    if draft is not None:
        assert alone.proposed > 0
    bm = colo.target.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    if colo.draft_model is not None:
        assert colo.drafter.num_q_rows == 0


def test_sampled_tokens_follow_top_k(tiny_llama, tiny_draft_close):
    """With top_k=1 sampling is greedy: equals the greedy target-only output exactly."""
    colo, gen = _gen(tiny_llama, tiny_draft_close)
    (sampled,) = gen.run([_req("s", 7, temperature=1.0, top_k=1)])
    ref_colo, ref_gen = _gen(tiny_llama, None)
    (greedy,) = ref_gen.run([GenerationRequest("g", (5, 6, 7, 8, 9, 5, 6, 7), 24, ignore_eos=True)])
    assert sampled.output == greedy.output


def _decode(decoder, seq_id, prompt, params, n, preempt_at=None, k=None):
    """Drive SpecDecoder directly for one sequence; at `preempt_at` tokens, release it on both
    engines and add it again with its prompt + output so far (what a preempting scheduler does)."""
    from specsplit.protocols import SeqAdd

    decoder.add(SeqAdd(seq_id, prompt, params), num_speculative_tokens=k)
    out: list[int] = []
    preempted = False
    while len(out) < n:
        if preempt_at is not None and not preempted and len(out) >= preempt_at:
            decoder.release([seq_id])
            decoder.add(SeqAdd(seq_id, prompt + tuple(out), params), num_speculative_tokens=k)
            preempted = True
        step = decoder.step({seq_id: n - len(out)})
        out.extend(step.tokens[seq_id])
    decoder.release([seq_id])
    return out[:n]


@pytest.mark.parametrize("draft", ["tiny_draft_close", None])
def test_seeded_output_survives_preemption_and_recompute(request, tiny_llama, draft):
    """Random numbers keyed by position: a sequence recomputed from its prompt + output continues
    with the tokens it would have produced (the per-step streams restarted from the seed)."""
    d = request.getfixturevalue(draft) if draft else None
    colo, _ = _gen(tiny_llama, d)
    params = SamplingParams(1.0, 1.0, 0, 2024)
    prompt = (5, 6, 7, 8, 9, 5, 6, 7)
    whole = _decode(colo.decoder, "a", prompt, params, 30)
    for cut in (1, 7, 16):
        assert _decode(colo.decoder, "a", prompt, params, 30, preempt_at=cut) == whole, cut
    bm = colo.target.block_manager
    assert bm.num_free_blocks == bm.num_blocks
