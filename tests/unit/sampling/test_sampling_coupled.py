"""Coupled sampling for seeded requests (specsplit.sampling.coupled): exact, and the tokens of a
seed do not depend on speculation on or off, K, the drafter, the batch or load."""
from __future__ import annotations

import torch
from scipy import stats

from specsplit.config import EngineConfig, SpecConfig
from specsplit.factory import build_colocated
from specsplit.request import GenerationRequest
from specsplit.scheduler import Scheduler
from specsplit.sampling import logits_to_probs
from specsplit.sampling.coupled import coupled_sample, gumbel_noise
from specsplit.sampling.params import SamplingParams
from tests.helpers.chisquare import pooled_chisquare

PROMPT = (5, 6, 7, 8, 9, 5, 6, 7)


def test_coupled_sample_is_an_exact_sampler():
    probs = torch.tensor([0.5, 0.25, 0.125, 0.0, 0.125])
    n = 20000
    counts = torch.bincount(torch.tensor([coupled_sample(probs, 9, pos) for pos in range(n)]), minlength=5)
    assert counts[3] == 0
    keep = probs > 0
    assert stats.chisquare(counts[keep].numpy(), (probs[keep] * n).numpy()).pvalue > 1e-3
    assert torch.equal(gumbel_noise(9, 3, 5), gumbel_noise(9, 3, 5))
    assert not torch.equal(gumbel_noise(9, 3, 5), gumbel_noise(9, 4, 5))


def _colo(target, draft, k, disable_by_batch_size=0, max_num_seqs=8):
    tc = EngineConfig(model=str(target), max_model_len=96, max_num_seqs=max_num_seqs)
    dc = None
    if draft == "ngram":
        dc = EngineConfig(model="ngram", max_model_len=96, max_num_seqs=max_num_seqs)
    elif draft is not None:
        dc = EngineConfig(model=str(draft), max_model_len=96, max_num_seqs=max_num_seqs)
    spec = SpecConfig(num_speculative_tokens=k if dc else 0, disable_by_batch_size=disable_by_batch_size)
    return build_colocated(tc, dc, spec, show_progress=False)


def _run(colo, seeds, max_tokens=24, temperature=0.9, top_k=0, **kw):
    gen = Scheduler(colo.decoder, colo.eos_token_ids, 8)
    reqs = [GenerationRequest(f"r{s}", PROMPT, max_tokens, SamplingParams(temperature, 1.0, top_k, s), ignore_eos=True,
                              **kw) for s in seeds]
    return gen.run(reqs)


def test_seeded_tokens_do_not_depend_on_speculation(tiny_llama, tiny_draft_close, tiny_draft_far):
    """Speculation on (model drafts at K 1 and 4, a far draft, n-gram) or off, alone or batched,
    and with speculation switched off by load (disable_by_batch_size=1 with 8 running): the same
    tokens for every seed. With rejection sampling (coupling=False) these differ."""
    seeds = list(range(8))
    target_only = [s.output for s in _run(_colo(tiny_llama, None, 0), seeds)]
    runs = {
        "close K=4": _colo(tiny_llama, tiny_draft_close, 4),
        "close K=1": _colo(tiny_llama, tiny_draft_close, 1),
        "far K=3": _colo(tiny_llama, tiny_draft_far, 3),
        "ngram K=4": _colo(tiny_llama, "ngram", 4),
        "close, off under load": _colo(tiny_llama, tiny_draft_close, 3, disable_by_batch_size=1),
    }
    for name, colo in runs.items():
        states = _run(colo, seeds)
        assert [s.output for s in states] == target_only, name
        if name != "close, off under load":
            assert sum(s.proposed for s in states) > 0, name
        alone = _run(colo, [5])[0]  # alone: this one speculates even with disable_by_batch_size=1
        assert alone.output == target_only[5], name
        colo.close()


def test_coupled_speculation_keeps_the_target_distribution(tiny_llama, tiny_draft_far):
    """Chi-square of the first two tokens over 3,000 seeds, speculating with a far draft at K=3."""
    colo = _colo(tiny_llama, tiny_draft_far, 3)
    n = 3000
    states = _run(colo, list(range(n)), max_tokens=2, temperature=1.0, top_k=12)
    assert sum(s.proposed for s in states) > 0 and sum(s.accepted for s in states) > 0
    colo.close()

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)

    def p_next(ctx):
        with torch.no_grad():
            logits = model(torch.tensor([ctx])).logits[0, -1:]
        return logits_to_probs(logits, torch.tensor([1.0]), torch.tensor([12]), torch.tensor([1.0]))[0].double()

    p0 = p_next(PROMPT)
    joint = {}
    for a in torch.nonzero(p0).flatten().tolist():
        p1 = p_next(PROMPT + (a,))
        for b in torch.nonzero(p1).flatten().tolist():
            joint[a, b] = float(p0[a] * p1[b])
    counts: dict = {}
    for s in states:
        assert tuple(s.output) in joint
        counts[tuple(s.output)] = counts.get(tuple(s.output), 0) + 1
    pvalue, _ = pooled_chisquare(counts, joint, n)
    print(f"FIGURE coupled sampling: first two tokens chi-square p {pvalue:.3g}")
    assert pvalue > 1e-3
