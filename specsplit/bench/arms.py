"""Benchmark arms: each turns prompts into timed generations, measured the same way.

Every arm generates exactly `new_tokens` per prompt (EOS ignored, so all arms do the same work),
greedy, batch 1 unless a concurrency is given. A warm-up generation is discarded; each prompt runs
`repeats` times and the median is kept. TTFT = time to the first generated token, TPOT = the rest
divided by (new_tokens - 1).

Batch-1 arms that are compared with each other run interleaved (`run_interleaved`): for each
prompt and repeat, every arm runs once in turn, so all of them see the same machine state. On the
shared 2-core VM this was built on, the speed of one and the same forward drifts by tens of
percent over minutes; arms timed one after the other would carry that drift into their ratios.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from specsplit.request import GenerationRequest
from specsplit.scheduler import Scheduler


@dataclass
class Timing:
    total_s: float
    ttft_s: float
    tokens: int
    proposed: int = 0
    accepted: int = 0
    steps: int = 0  # speculative steps (verified >= 1 draft); 0 where unknown (a split arm against an old gateway)
    per_position: list[int] = field(default_factory=list)  # steps that accepted draft j; [] where unknown
    output: list[int] = field(default_factory=list)  # the generated token ids ([] where not kept)


@dataclass
class ArmResult:
    name: str
    timings: list[Timing]
    extra: dict = field(default_factory=dict)

    def summary(self) -> dict:
        tok = sum(t.tokens for t in self.timings)
        total = [t.total_s for t in self.timings]
        # Throughput over wall time: at concurrency c the requests of one batch share its wall
        # time, so each batch's wall counts once, not once per request.
        wall = self.extra.get("wall_s", sum(total))
        ttft = [t.ttft_s for t in self.timings]
        tpot = [(t.total_s - t.ttft_s) / max(1, t.tokens - 1) for t in self.timings]
        proposed = sum(t.proposed for t in self.timings)
        accepted = sum(t.accepted for t in self.timings)
        spec_steps = sum(t.steps for t in self.timings)
        k = max((len(t.per_position) for t in self.timings), default=0)
        per_pos = [sum(t.per_position[j] for t in self.timings if j < len(t.per_position)) for j in range(k)]
        out = {
            "arm": self.name,
            "tokens_per_s": tok / wall if wall else 0.0,
            "median_request_tokens_per_s": statistics.median(t.tokens / t.total_s for t in self.timings),
            "ttft_ms": 1000 * statistics.median(ttft),
            "tpot_ms": 1000 * statistics.median(tpot),
            "acceptance_rate": accepted / proposed if proposed else None,
            "mean_accepted_length": accepted / spec_steps if proposed and spec_steps else None,
            "per_position_acceptance": [n / spec_steps for n in per_pos] if spec_steps else [],
            "proposed_draft_tokens": proposed,
            "accepted_draft_tokens": accepted,
            "generated_tokens": tok,
        }
        out.update(self.extra)
        return out


def median_timing(runs: list[Timing]) -> Timing:
    runs = sorted(runs, key=lambda t: t.total_s)
    return runs[len(runs) // 2]


def generate_timed(colo, batch: list[list[int]], new_tokens: int, k: int | None, tag: str,
                   max_num_seqs: int | None = None) -> list[Timing]:
    """One batch of greedy generations through the colocated SpecDecoder, timed per request."""
    gen = Scheduler(colo.decoder, colo.eos_token_ids, max_num_seqs or max(len(batch), 1))
    reqs = [GenerationRequest(f"{tag}-{i}", tuple(p), new_tokens, ignore_eos=True, num_speculative_tokens=k or 0)
            for i, p in enumerate(batch)]
    first: dict[str, float] = {}
    t0 = time.perf_counter()
    states = [gen.submit(r) for r in reqs]
    while gen.waiting or gen.running:
        events = gen.step()
        now = time.perf_counter()
        for state, kept in events:
            if kept and state.request.request_id not in first:
                first[state.request.request_id] = now
    done = time.perf_counter()
    return [Timing(done - t0, first.get(st.request.request_id, done) - t0, len(st.output), st.proposed,
                   st.accepted, st.speculative_steps, list(st.accepted_per_position), list(st.output))
            for st in states]


@dataclass
class Arm:
    """One batch-1 arm for run_interleaved: `once(prompt, tag)` generates and times one request."""

    name: str
    once: Callable[[list[int], str], Timing]
    k: int = 0
    extra: dict = field(default_factory=dict)


def colocated_arm(name: str, colo, new_tokens: int, k: int | None = None, **extra) -> Arm:
    """specsplit in-process (target-only when colo has no drafter), through the server's SpecDecoder."""
    return Arm(name, lambda p, tag: generate_timed(colo, [p], new_tokens, k, tag)[0], k or 0, extra)


def run_interleaved(arms: list[Arm], prompts: list[list[int]], repeats: int,
                    progress: Callable[[], None] | None = None) -> list[ArmResult]:
    """Every arm warms up once (discarded); then per prompt and repeat each arm runs once, in
    turn; per prompt the median run of each arm is kept."""
    for arm in arms:
        arm.once(prompts[0], "warm")
    kept: dict[str, list[Timing]] = {a.name: [] for a in arms}
    for i, p in enumerate(prompts):
        runs: dict[str, list[Timing]] = {a.name: [] for a in arms}
        for r in range(repeats):
            for arm in arms:
                runs[arm.name].append(arm.once(p, f"p{i}r{r}"))
        for arm in arms:
            kept[arm.name].append(median_timing(runs[arm.name]))
            if progress:
                progress()
    return [ArmResult(a.name, kept[a.name], {"concurrency": 1, "k": a.k, "interleaved": len(arms), **a.extra})
            for a in arms]


def hf_arm(name: str, model, new_tokens: int, assistant=None, assistant_mode: str | None = None,
           k: int | None = None, **extra) -> Arm:
    """transformers generate (optionally assisted generation with `assistant`)."""
    from transformers.generation.streamers import BaseStreamer

    class FirstToken(BaseStreamer):
        def __init__(self):
            self.calls = 0
            self.first = None

        def put(self, value):
            self.calls += 1
            if self.calls == 2 and self.first is None:  # first call carries the prompt
                self.first = time.perf_counter()

        def end(self):
            pass

    def once(p: list[int], tag: str) -> Timing:
        ids = torch.tensor([p])
        kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        if assistant is not None:
            kwargs["assistant_model"] = assistant
            assistant.generation_config.num_assistant_tokens = k or 5
            assistant.generation_config.num_assistant_tokens_schedule = assistant_mode or "constant"
            assistant.generation_config.assistant_confidence_threshold = 0.0 if assistant_mode == "constant" else 0.4
        streamer = FirstToken()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, streamer=streamer, **kwargs)
        total = time.perf_counter() - t0
        n = out.shape[1] - ids.shape[1]
        return Timing(total, (streamer.first or t0 + total) - t0, n, output=out[0, ids.shape[1]:].tolist())

    return Arm(name, once, k or 0, extra)
