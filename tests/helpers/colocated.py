"""In-process engines over the tiny checkpoints, for tests: one colocated builder with the small
limits most tests use, and the target alone as a greedy reference."""
from __future__ import annotations

from typing import Callable, Sequence

from specsplit.config import EngineConfig, SpecConfig
from specsplit.factory import build_colocated
from specsplit.request import GenerationRequest
from specsplit.scheduler import Scheduler


def tiny_colocated(target, draft, max_model_len: int, k: int = 3, num_blocks: int | None = None,
                   max_num_seqs: int = 8, max_prefill_tokens: int = 64, **engine):
    """target (+ draft, each with the same engine limits) in one process; K = k when there is a draft
    (speculation never switched off by batch size), target-only otherwise."""
    kw = dict(max_model_len=max_model_len, max_num_seqs=max_num_seqs, max_prefill_tokens=max_prefill_tokens, **engine)
    if num_blocks:
        kw["num_blocks"] = num_blocks
    tc = EngineConfig(model=str(target), **kw)
    dc = EngineConfig(model=str(draft), **kw) if draft else None
    return build_colocated(tc, dc, SpecConfig(num_speculative_tokens=k if draft else 0, disable_by_batch_size=0),
                           show_progress=False)


def greedy_alone(colo) -> Callable[[Sequence[int], int], list[int]]:
    """run(prompt, max_tokens) -> the greedy tokens of `colo` for that prompt alone (batch 1, EOS
    ignored); each (prompt, max_tokens) is generated once."""
    cache: dict = {}

    def run(prompt: Sequence[int], max_tokens: int) -> list[int]:
        key = (tuple(prompt), max_tokens)
        if key not in cache:
            (req,) = Scheduler(colo.decoder, colo.eos_token_ids, 1).run(
                [GenerationRequest("solo", tuple(prompt), max_tokens, ignore_eos=True)])
            cache[key] = list(req.output)
        return cache[key]

    return run
