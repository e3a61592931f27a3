"""The seed bug in miniature: a KV cache sized as if the draft's weights were not there.

vLLM once sized the target's cache from a profile that left out the draft model's weights and then
ran out of memory allocating it. Here the budget would hold the target's cache exactly if the
draft (16 MiB of weights, little KV per token) were ignored; colocated mode must take both models'
weights and peaks off the one budget first, size smaller caches, and a full run (profile, then a
batch at max_num_seqs) must stay within the budget, measured, not computed.
"""
from __future__ import annotations

import random

from specsplit.config import SpecConfig
from specsplit.factory import build_colocated, plan_memory
from specsplit.request import GenerationRequest
from specsplit.scheduler import Scheduler
from specsplit.kv.meters import TorchMeter, peak_rss_bytes, reset_peak_rss, rss_bytes, trim_host_memory
from specsplit.sampling.params import SamplingParams
from tests.unit.kv.conftest import MiB, engine_cfg

SPEC = SpecConfig(num_speculative_tokens=3)
BUDGET = 96 * MiB


def _cfgs(kv_target, heavy_draft):
    t = engine_cfg(kv_target, memory_budget_bytes=BUDGET, max_model_len=128, max_num_seqs=4, kv_cap=False)
    d = engine_cfg(heavy_draft, max_model_len=128, max_num_seqs=4, kv_cap=False)
    return t, d


def test_colocated_counts_the_draft_weights(warm, kv_target, heavy_draft):
    t, d = _cfgs(kv_target, heavy_draft)
    alone = plan_memory(t, None, SPEC).services["verifier"]  # what a draft-blind profile would size
    joint = plan_memory(t, d, SPEC, colocated=True)
    v, dr = joint.services["verifier"], joint.services["drafter"]
    assert joint.joint and joint.budget_bytes == BUDGET
    assert dr.weights_bytes > 15 * MiB
    # The draft-blind cache fits the budget only without the draft: with it, it would not.
    assert alone.weights_bytes + alone.activation_peak_bytes + alone.kv_cache_bytes + dr.weights_bytes > BUDGET
    # Colocated: both models' weights and peaks came off first, so both caches are smaller ...
    assert v.num_blocks < alone.num_blocks
    assert v.kv_cache_bytes <= alone.kv_cache_bytes - dr.weights_bytes + 2 * MiB
    # ... they hold the same tokens, and everything fits in the one budget.
    assert v.max_tokens == dr.max_tokens
    assert v.used_bytes + dr.used_bytes <= BUDGET
    assert v.budget_bytes + dr.budget_bytes == BUDGET


def test_full_run_stays_within_the_budget(warm, kv_target, heavy_draft):
    t, d = _cfgs(kv_target, heavy_draft)
    trim_host_memory()
    base = rss_bytes()
    reset_peak_rss()
    colo = build_colocated(t, d, SPEC, show_progress=False)
    plan = colo.plan
    v, dr = plan.services["verifier"], plan.services["drafter"]
    assert colo.target.runner.kv.nbytes == v.kv_cache_bytes and colo.drafter.runner.kv.nbytes == dr.kv_cache_bytes

    # A batch at max_num_seqs: long prompts (full contexts), sampling on, prompt chunks and verification.
    rng = random.Random(0)
    reqs = [
        GenerationRequest(f"r{i}", tuple(rng.randrange(256) for _ in range(100)), 20,
                          SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=i), ignore_eos=True)
        for i in range(t.max_num_seqs)
    ]
    gen = Scheduler(colo.decoder, colo.eos_token_ids, max_num_seqs=t.max_num_seqs)
    with TorchMeter("cpu") as run:
        states = gen.run(reqs)
    assert all(len(s.output) == 20 for s in states)
    peak = peak_rss_bytes() - base
    # Torch alone: the run's transient peak is within what the profile measured for both steps.
    assert run.peak <= v.activation_peak_bytes + dr.activation_peak_bytes
    # The process as a whole (weights, caches, activations, everything else) stayed in the budget.
    assert peak <= BUDGET, f"peak RSS growth {peak / MiB:.1f} MiB > budget {BUDGET / MiB:.1f} MiB; plan {plan.to_dict()}"
    colo.close()
