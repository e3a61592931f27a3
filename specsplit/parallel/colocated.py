"""`specsplit serve --tensor-parallel-size N`: the colocated server with a tensor-parallel target.

The target comes up as in the verifier service (rank 0 in this process, N-1 supervised workers,
one plan per rank); the draft model, if any, is loaded in this process on its own budget after
the target. This is the one place the colocated mode does not plan one joint budget: the target's
ranks are sized first (on the CPU each gets 1/N of the host's budget), then the draft on the
budget flags again. The drafter stays at one rank.
"""
from __future__ import annotations

import logging
from dataclasses import replace

import torch

from specsplit.config import EngineConfig, SpecConfig
from specsplit.kv.profiler import MemoryPlan

log = logging.getLogger(__name__)


def build_colocated_tp(target: EngineConfig, draft: EngineConfig | None, spec: SpecConfig, world: int,
                       show_progress: bool = False):
    from specsplit.engine import NgramDrafter
    from specsplit.factory import DRAFTER, NGRAM, Colocated, colocated_decoder, draft_engine_and_plan, without_lookup
    from specsplit.models.loader import load_tokenizer
    from specsplit.parallel.build import TPMemoryPlan
    from specsplit.parallel.group import TPGroup

    k = spec.num_speculative_tokens if draft is not None else 0
    group, verifier, t_plan = TPGroup.launch(target, replace(spec, num_speculative_tokens=k), world,
                                             threads=torch.get_num_threads(), show_progress=show_progress)
    try:
        loaded = group.loaded
        tokenizer = load_tokenizer(loaded.hf_dir)
        drafter, d_plan = None, None
        if draft is not None:
            base, _ = without_lookup(draft)
            if base.model == NGRAM:
                drafter = NgramDrafter(spec.ngram_min, spec.ngram_max, loaded.config.vocab_size, target.max_model_len)
            else:
                drafter, d_plan = draft_engine_and_plan(draft, spec, show_progress, allocate=True, vocab_size=loaded.config.vocab_size)
        services = dict(t_plan.services)
        if d_plan is not None:
            services[DRAFTER] = d_plan.services[DRAFTER]
        plan = TPMemoryPlan(joint=False, budget_bytes=t_plan.budget_bytes + (d_plan.budget_bytes if d_plan else 0),
                            services=services, method=t_plan.method, ranks=t_plan.ranks)
        for line in plan.log_lines() + (MemoryPlan.log_lines(d_plan) if d_plan else []):
            log.info("%s", line)
        return Colocated(colocated_decoder(verifier, drafter, spec, target.max_model_len), verifier, drafter, loaded,
                         None, tokenizer, plan)
    except BaseException:
        group.close()
        raise
