"""Over 1,000 requests through an engine, live memory returns to its baseline: no leak.

Three views of "live memory", each compared before and after: the tensors reachable from Python
(a census of every tensor object's storage), the process's resident set, and the engines' own
state (free blocks, sequences). One chunk also runs under a TorchMeter, whose net change over a
chunk of requests must be exactly zero.
"""
from __future__ import annotations

import gc
import random
import warnings

import torch

from specsplit.config import SpecConfig
from specsplit.factory import build_colocated
from specsplit.request import GenerationRequest
from specsplit.scheduler import Scheduler
from specsplit.kv.meters import TorchMeter, rss_bytes, trim_host_memory
from specsplit.sampling.params import SamplingParams
from tests.unit.kv.conftest import MiB, engine_cfg

N = 32


def _requests(rng: random.Random, start: int, n: int) -> list[GenerationRequest]:
    out = []
    for i in range(start, start + n):
        params = SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=i) if i % 2 else SamplingParams()
        prompt = tuple(rng.randrange(3, 256) for _ in range(rng.randint(1, 40)))
        out.append(GenerationRequest(f"req-{i}", prompt, rng.randint(1, 6), params, ignore_eos=i % 3 != 0))
    return out


def _tensor_census() -> int:
    """Bytes of the distinct storages behind every tensor object the garbage collector knows."""
    gc.collect()
    seen = {}
    with warnings.catch_warnings():  # isinstance() on some lazily deprecated torch objects warns
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor) and not obj.is_mkldnn:  # packed weights have no storage
                st = obj.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def test_a_thousand_requests_leave_memory_where_it_was(warm, tiny_llama):
    t = engine_cfg(tiny_llama, memory_budget_bytes=256 * MiB, max_num_seqs=N)
    colo = build_colocated(t, engine_cfg("ngram", max_num_seqs=N), SpecConfig(num_speculative_tokens=3), show_progress=False)
    gen = Scheduler(colo.decoder, colo.eos_token_ids, max_num_seqs=N)
    rng = random.Random(0)
    gen.run(_requests(rng, 0, 2 * N))  # warm: every code path once

    census0 = _tensor_census()
    trim_host_memory()
    rss0 = rss_bytes()
    finished = sum(s.finished for s in gen.run(_requests(rng, 1000, 900)))
    with TorchMeter("cpu") as m:
        finished += sum(s.finished for s in gen.run(_requests(rng, 2000, 101)))
    census1 = _tensor_census()
    trim_host_memory()
    rss_growth = rss_bytes() - rss0

    assert finished == 1001
    assert m.net == 0 and m.peak > 0
    assert census1 == census0
    bm = colo.target.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not bm.seq_ids() and not colo.target.seqs
    assert not colo.drafter.seqs and not colo.decoder.tracks and not gen.running and not gen.waiting
    assert rss_growth < 4 * MiB, f"RSS grew {rss_growth / MiB:.2f} MiB over 1001 requests"
    colo.close()
