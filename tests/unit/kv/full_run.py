"""The full-run budget measurement of test_profiler_seed.py, in a process of its own.

Peak RSS growth is a property of the whole process: in the suite's process it also counts whatever
earlier tests left mapped or cached (a library first paged in, an allocator's arenas, under
pytest-xdist a worker's own threads), so the number depended on which tests ran before. Here the
process does only this: a warm-up plan (the one-time costs of a first profile run), then the
measured build + batch. Prints one JSON line.

    python -m tests.unit.kv.full_run WARM_TARGET WARM_DRAFT KV_TARGET HEAVY_DRAFT BUDGET_BYTES
"""
from __future__ import annotations

import json
import os
import random
import sys

import torch


def main(warm_target: str, warm_draft: str, kv_target: str, heavy_draft: str, budget: int) -> dict:
    os.environ["SPECSPLIT_LINEAR_KERNEL"] = "dense"  # as tests/unit/kv/conftest.py's _dense_kernels
    torch.set_num_threads(1)
    from specsplit.config import SpecConfig
    from specsplit.factory import build_colocated
    from specsplit.kv.meters import TorchMeter, peak_rss_bytes, reset_peak_rss, rss_bytes, trim_host_memory
    from specsplit.request import GenerationRequest
    from specsplit.sampling.params import SamplingParams
    from specsplit.scheduler import Scheduler
    from tests.unit.kv.conftest import engine_cfg

    spec = SpecConfig(num_speculative_tokens=3)
    build_colocated(engine_cfg(warm_target, memory_budget_bytes=1 << 30), engine_cfg(warm_draft), spec,
                    show_progress=False).close()
    t = engine_cfg(kv_target, memory_budget_bytes=budget, max_model_len=128, max_num_seqs=4, kv_cap=False)
    d = engine_cfg(heavy_draft, max_model_len=128, max_num_seqs=4, kv_cap=False)
    trim_host_memory()
    base = rss_bytes()
    reset_peak_rss()
    colo = build_colocated(t, d, spec, show_progress=False)
    plan = colo.plan
    v, dr = plan.services["verifier"], plan.services["drafter"]
    # A batch at max_num_seqs: long prompts (full contexts), sampling on, prompt chunks and verification.
    rng = random.Random(0)
    reqs = [GenerationRequest(f"r{i}", tuple(rng.randrange(256) for _ in range(100)), 20,
                              SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=i), ignore_eos=True)
            for i in range(t.max_num_seqs)]
    gen = Scheduler(colo.decoder, colo.eos_token_ids, max_num_seqs=t.max_num_seqs)
    with TorchMeter("cpu") as run:
        states = gen.run(reqs)
    out = {"peak_rss_growth": peak_rss_bytes() - base, "torch_peak": run.peak,
           "profiled_peaks": v.activation_peak_bytes + dr.activation_peak_bytes,
           "kv_matches_plan": colo.target.runner.kv.nbytes == v.kv_cache_bytes
           and colo.drafter.runner.kv.nbytes == dr.kv_cache_bytes,
           "outputs": [len(s.output) for s in states], "plan": plan.to_dict()}
    colo.close()
    return out


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:5], int(sys.argv[5]))))
