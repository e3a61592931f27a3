"""One rank of a tensor-parallel target: load, shard, profile and size its KV cache, in step with
the other ranks.

Every rank runs `build_rank` at the same time (SPMD): each loads the model and keeps its shard,
profiles its own memory with the real engine code (the profile run's forwards are collectives, so
the ranks run them together; the run is seeded, and every rank sees the same gathered logits,
so they take the same steps), and sizes its own cache from its own budget. The ranks then agree:
if any rank's budget is short, every rank raises one MemoryBudgetError that has each rank's
numbers; otherwise all take the smallest block count (rank 0's block manager addresses every
rank's cache with the same block ids). The plan rank 0 reports lists every rank.

Budgets: on CUDA each rank has its own device (cuda:base+rank) and budget. On the CPU the ranks
share the host's memory, so each rank gets 1/N of it (--memory-budget / N, or
--memory-utilization / N of system RAM).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Callable, TypeVar

import torch
import torch.distributed as dist

from specsplit.config import EngineConfig, SpecConfig
from specsplit.kv.profiler import MemoryBudgetError, MemoryPlan, MemoryProfiler, ServicePlan, fmt_bytes

log = logging.getLogger(__name__)
T = TypeVar("T")


class RankFailed(RuntimeError):
    """Some rank failed a start-up stage; the message has every failing rank's error."""


def rank_config(cfg: EngineConfig, rank: int, world: int) -> EngineConfig:
    """The engine config rank `rank` runs with: its device, its share of a CPU host's memory."""
    dev = torch.device(cfg.device)
    if dev.type == "cuda":  # NCCL, one device per rank. NOT TESTED: no GPU on the machines this was written on.
        base = dev.index or 0
        return replace(cfg, device=f"cuda:{base + rank}")
    if cfg.memory_budget_bytes is not None:
        return replace(cfg, memory_budget_bytes=max(1, cfg.memory_budget_bytes // world))
    return replace(cfg, memory_utilization=cfg.memory_utilization / world)


def agree(stage: str, fn: Callable[[], T], group) -> T:
    """Run fn on every rank; if it raised anywhere, raise on every rank with all ranks' errors."""
    try:
        out, err = fn(), None
    except Exception as e:  # reported to every rank below
        out, err = None, e
    world = dist.get_world_size(group)
    errors: list = [None] * world
    dist.all_gather_object(errors, None if err is None else f"{type(err).__name__}: {err}", group=group)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        msg = f"tensor-parallel start-up ({stage}) failed on " + "; ".join(f"rank {r}: {e}" for r, e in failed)
        budget = isinstance(err, MemoryBudgetError) or any("MemoryBudgetError" in e for _, e in failed)
        raise (MemoryBudgetError if budget else RankFailed)(msg) from err
    return out


@dataclass
class TPMemoryPlan(MemoryPlan):
    """Rank 0's plan, plus every rank's (to_dict()["tensor_parallel"] = {"size", "ranks": [...]})."""

    ranks: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        d = super().to_dict()
        d["tensor_parallel"] = {"size": len(self.ranks), "ranks": self.ranks}
        return d

    def log_lines(self) -> list[str]:
        lines = []
        for r, p in enumerate(self.ranks):
            s = ServicePlan(**p["services"]["verifier"])
            lines.append(
                f"memory plan [verifier rank {r}/{len(self.ranks)}] {s.model} on {s.device} ({s.dtype}): budget "
                f"{fmt_bytes(s.budget_bytes)}; weights {fmt_bytes(s.weights_bytes)}; activation peak "
                f"{fmt_bytes(s.activation_peak_bytes)}; non-torch {fmt_bytes(s.non_torch_bytes)}; KV cache "
                f"{fmt_bytes(s.kv_cache_bytes)} = {s.num_blocks} blocks x {s.block_size} = {s.max_tokens} tokens"
                + (f", limited by {s.kv_limited_by}" if s.kv_limited_by != "budget" else ""))
        return lines


def build_rank(cfg: EngineConfig, spec: SpecConfig, rank: int, world: int, startup_group, compute_group,
               show_progress: bool = False):
    """(TargetEngine over this rank's shard and cache, TPMemoryPlan, the LoadedModel) on every rank."""
    from specsplit.engine_build import VERIFIER, ModelService, allocate_engine, check_model_len, kv_shape, load_for, profile_steps
    from specsplit.parallel.tensor_parallel import check_shardable, shard_model, unpacked_load

    rcfg = rank_config(cfg, rank, world)
    t = ModelService(VERIFIER, rcfg, spec.num_speculative_tokens)
    prof = agree("budget", lambda: MemoryProfiler(rcfg.device, rcfg.memory_budget_bytes, rcfg.memory_utilization),
                 startup_group)

    def load():
        with unpacked_load() as policy:  # dense weights to shard; kernels chosen for the shard after
            # weights fp32 (or bf16): the shards are cut from dense weights (a GGUF's blocks are not split)
            loaded = load_for(replace(rcfg, deterministic=False, weights="bf16" if rcfg.weights == "bf16" else "fp32"),
                              show_progress and rank == 0)
        check_shardable(loaded.config, world)
        loaded.config = shard_model(loaded.model, rank, world, compute_group, policy)
        if rcfg.deterministic:
            from specsplit.models.deterministic import make_deterministic

            make_deterministic(loaded.model)
        return loaded

    def load_measured():
        t.loaded = prof.load(VERIFIER, load)
        check_model_len(t.loaded, rcfg)

    agree("load", load_measured, startup_group)  # also a barrier: the profile's collectives start together

    def profile_and_plan() -> MemoryPlan:
        setup, steps = profile_steps(t)
        prof.profile(VERIFIER, setup, steps)
        return prof.plan({VERIFIER: kv_shape(t.loaded, rcfg)}, models={VERIFIER: rcfg.model}, dtypes={VERIFIER: rcfg.dtype})

    plan = agree("memory profile", profile_and_plan, startup_group)
    plans: list = [None] * world
    dist.all_gather_object(plans, plan.to_dict(), group=startup_group)
    blocks = min(p["services"][VERIFIER]["num_blocks"] for p in plans)
    for p in plans:  # every rank allocates the smallest cache
        sp = p["services"][VERIFIER]
        if sp["num_blocks"] > blocks:
            sp.update(num_blocks=blocks, kv_cache_bytes=blocks * sp["kv_bytes_per_block"],
                      max_tokens=blocks * sp["block_size"], kv_limited_by=f"rank {[q['services'][VERIFIER]['num_blocks'] for q in plans].index(blocks)}")
    mine = ServicePlan(**plans[rank]["services"][VERIFIER])
    engine = allocate_engine(t, mine)
    tp_plan = TPMemoryPlan(joint=False, budget_bytes=sum(p["budget_bytes"] for p in plans),
                           services={VERIFIER: mine}, method=plan.method, ranks=plans)
    return engine, tp_plan, t.loaded
