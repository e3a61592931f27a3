"""Assemble engines from model arguments: load weights, profile memory, size the KV cache, wire up.

Every engine comes up the same way (specsplit.kv.profiler):
    load the weights (measured) -> profile run at the largest step (measured) -> size the cache
    from what the budget leaves -> log the plan -> allocate the cache.

    build_colocated(target, draft, spec)   both in one process (`serve`, `generate`): on one device,
                                           one joint budget for both models
    build_target_engine(cfg, spec)         the verifier service alone, its own budget
    build_draft_engine(cfg, spec)          the drafter service alone (a model, or 'ngram')
    plan_memory(target, draft, spec, colocated)
                                           the plan without allocating a cache (`specsplit profile`)

Each returns the MemoryPlan it sized with; MemoryPlan.to_dict() is what GetServerInfo reports.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Callable, NamedTuple

import torch

from specsplit.calibration import StepCosts, calibrate_drafter, calibrate_verifier
from specsplit.config import EngineConfig, SpecConfig
from specsplit.engine import DraftEngine, NgramDrafter, TargetEngine
from specsplit.feature_drafter import FeatureDrafter, calibrate_feature_drafter, head_bytes, load_feature_drafter
from specsplit.hybrid_drafter import HybridDrafter, split_draft_name
from specsplit.kv.bounded import BoundedRunner, ForwardBound
from specsplit.kv.profile_run import make_profile_runner, profile_shapes, run_drafter_shape, run_verifier_shape
from specsplit.kv.profiler import KVShape, MemoryPlan, MemoryProfiler, ServicePlan
from specsplit.models.loader import LoadedModel, load_model, load_tokenizer
from specsplit.models.registry import is_eagle3
from specsplit.models.runner import ModelRunner
from specsplit.spec import SpecDecoder

log = logging.getLogger(__name__)

NGRAM = "ngram"
VERIFIER, DRAFTER = "verifier", "drafter"


def load_for(cfg: EngineConfig, show_progress: bool = True) -> LoadedModel:
    loaded = load_model(cfg.model, cfg.device, cfg.dtype, max_positions=cfg.max_model_len + 16, show_progress=show_progress,
                        weights=cfg.weights)
    if cfg.extra.get("deterministic"):  # --deterministic: batch-invariant numerics (models/deterministic.py)
        from specsplit.models.deterministic import make_deterministic

        make_deterministic(loaded.model)
    return loaded


def check_model_len(loaded: LoadedModel, cfg: EngineConfig) -> None:
    limit = loaded.config.max_position_embeddings
    if cfg.max_model_len > limit:
        raise ValueError(f"--max-model-len {cfg.max_model_len} exceeds what {cfg.model} supports ({limit} positions)")


def forward_bound(cfg: EngineConfig, num_speculative_tokens: int) -> ForwardBound:
    """The largest forward an engine of cfg may run: what the profile measures, what BoundedRunner keeps."""
    return ForwardBound(
        max_num_seqs=cfg.max_num_seqs,
        window=max(1, num_speculative_tokens + 1),
        max_prefill_tokens=max(1, min(cfg.max_prefill_tokens, cfg.max_model_len)),
    )


def kv_shape(loaded: LoadedModel, cfg: EngineConfig) -> KVShape:
    return KVShape.for_model(
        loaded.config, cfg.dtype, cfg.block_size, cfg.max_model_len, cfg.max_num_seqs, cfg.num_blocks,
        cap=bool(cfg.extra.get("kv_cap", True)),
    )


def make_runner(loaded: LoadedModel, cfg: EngineConfig, num_blocks: int, num_speculative_tokens: int = 0) -> ModelRunner:
    return BoundedRunner(loaded.model, num_blocks, cfg.block_size, cfg.max_model_len, forward_bound(cfg, num_speculative_tokens))


# ---- measuring one budget's services ----------------------------------------------------------


@dataclass
class _Service:
    name: str  # VERIFIER | DRAFTER
    cfg: EngineConfig
    k: int  # speculative tokens its steps carry (0: target-only)
    loaded: LoadedModel | None = None
    after_load: Callable[[LoadedModel], None] | None = None


def _profile_steps(s: _Service):
    model, cfg = s.loaded.model, s.cfg
    bound = forward_bound(cfg, s.k)
    engine_cls = TargetEngine if s.name == VERIFIER else DraftEngine
    run_shape = run_verifier_shape if s.name == VERIFIER else run_drafter_shape
    # A drafter keeps the q rows of its chain of drafts: K, or K + 1 + K while a gateway pre-drafts
    # (specsplit/spec.py); the profile drafts the longer chain so its rows are in the plan.
    k = max(0, min(s.k if s.name == VERIFIER else 2 * s.k + 1, cfg.max_model_len - 2))

    def setup():
        return engine_cls(make_profile_runner(model, cfg.block_size, cfg.max_model_len, bound), bound.max_prefill_tokens)

    steps = {shape.name: (lambda eng, shape=shape: run_shape(eng, shape, k)) for shape in profile_shapes(bound, cfg.max_model_len)}
    return setup, steps


def _plan_budget(services: list[_Service], show_progress: bool, joint: bool,
                 after_loads: Callable[[list[_Service]], None] | None = None) -> MemoryPlan:
    """Load, profile and size services that share one budget (set by the first one's flags)."""
    lead = services[0].cfg
    prof = MemoryProfiler(lead.device, lead.memory_budget_bytes, lead.memory_utilization, joint=joint)
    for s in services:
        s.loaded = prof.load(s.name, lambda s=s: load_for(s.cfg, show_progress))
        check_model_len(s.loaded, s.cfg)
        if s.after_load is not None:
            s.after_load(s.loaded)
    if after_loads is not None:
        after_loads(services)
    for s in services:
        setup, steps = _profile_steps(s)
        prof.profile(s.name, setup, steps)
    plan = prof.plan(
        {s.name: kv_shape(s.loaded, s.cfg) for s in services},
        models={s.name: s.cfg.model for s in services},
        dtypes={s.name: s.cfg.dtype for s in services},
    )
    for s in services:
        plan.services[s.name].weights = s.loaded.weights
    return plan


def _ngram_plan(cfg: EngineConfig | None) -> MemoryPlan:
    device = str(torch.device(cfg.device)) if cfg is not None else "cpu"
    model = cfg.model if cfg is not None and is_eagle3(cfg.model) else NGRAM
    return MemoryPlan(joint=False, budget_bytes=0, services={DRAFTER: ServicePlan.zeros(DRAFTER, model, device)})


def _feature_drafter(cfg: EngineConfig, spec: SpecConfig, embedding=None, num_target_layers=None,
                     plan: MemoryPlan | None = None) -> FeatureDrafter:
    """An EAGLE-3 head (its weights recorded in the plan's drafter row), calibrated for the K policy."""
    drafter = load_feature_drafter(cfg.model, cfg.max_model_len, cfg.device, cfg.dtype, embedding, num_target_layers)
    if plan is not None and DRAFTER in plan.services:
        plan.services[DRAFTER].weights_bytes = head_bytes(drafter.head)
        plan.services[DRAFTER].dtype = str(cfg.dtype).replace("torch.", "")
    if spec.k_policy == "auto" and spec.num_speculative_tokens > 0:
        drafter.step_costs = calibrate_feature_drafter(drafter, cfg.max_num_seqs)
    return drafter


def _with_drafter_zeros(plan: MemoryPlan, cfg: EngineConfig) -> MemoryPlan:
    plan.services[DRAFTER] = _ngram_plan(cfg).services[DRAFTER]
    return plan


def _vocab_check(target_vocab: int) -> Callable[[LoadedModel], None]:
    def check(draft: LoadedModel) -> None:
        if draft.config.vocab_size != target_vocab:
            raise ValueError(
                f"draft vocabulary ({draft.config.vocab_size}) differs from the target's "
                f"({target_vocab}); they must share a tokenizer"
            )

    return check


def _same_device(a: EngineConfig, b: EngineConfig) -> bool:
    da, db = torch.device(a.device), torch.device(b.device)
    if da.type == "cuda" and db.type == "cuda":
        cur = torch.cuda.current_device() if torch.cuda.is_available() else 0
        return (da.index if da.index is not None else cur) == (db.index if db.index is not None else cur)
    return da == db


def _plan_models(target: EngineConfig, draft: EngineConfig | None, spec: SpecConfig, joint: bool, show_progress: bool,
                 after_target: Callable[[LoadedModel], None] | None = None) -> tuple[MemoryPlan, _Service, _Service | None]:
    """Measure and size target (+ draft model): one budget on a shared device when joint, else one each."""
    draft, _ = _without_lookup(draft)  # MODEL+ngram: prompt lookup needs no memory of its own
    has_draft = draft is not None and draft.model != NGRAM and not is_eagle3(draft.model)
    k = spec.num_speculative_tokens if draft is not None else 0
    t = _Service(VERIFIER, target, k, after_load=after_target)
    d = _Service(DRAFTER, draft, k) if has_draft else None
    if d is not None and joint and _same_device(target, draft):
        def check(services):
            _vocab_check(services[0].loaded.config.vocab_size)(services[1].loaded)

        plan = _plan_budget([t, d], show_progress, joint=True, after_loads=check)
        return plan, t, d
    # Target alone on its budget; with the n-gram drafter (no memory) that budget is still the joint one.
    t_plan = _plan_budget([t], show_progress, joint=joint and d is None and draft is not None)
    if d is None:
        plan = _with_drafter_zeros(t_plan, draft) if draft is not None else t_plan
        return plan, t, None
    d.after_load = _vocab_check(t.loaded.config.vocab_size)
    d_plan = _plan_budget([d], show_progress, joint=False)
    return MemoryPlan.merge([t_plan, d_plan]), t, d


def plan_memory(target: EngineConfig, draft: EngineConfig | None = None, spec: SpecConfig = SpecConfig(),
                colocated: bool = True, show_progress: bool = False) -> MemoryPlan:
    """The plan the services would start with, without allocating a KV cache (`specsplit profile`).

    colocated: both models in one process, one joint budget when they share a device. Otherwise
    each service on its own budget and device, measured one after the other.
    """
    if colocated:  # as build_colocated: the tokenizer is in the window too
        plan, _, _ = _plan_models(target, draft, spec, joint=True, show_progress=show_progress,
                                  after_target=lambda loaded: load_tokenizer(loaded.hf_dir))
        return plan
    # As the separate services would start: the verifier sized for k drafts, then the drafter.
    t = _Service(VERIFIER, target, spec.num_speculative_tokens if draft is not None else 0)
    t_plan = _plan_budget([t], show_progress, joint=False)
    if draft is None:
        return t_plan
    vocab = t.loaded.config.vocab_size
    t.loaded = None  # a separate process would not hold the target
    _, d_plan = _draft_plan(draft, spec, show_progress, allocate=False, vocab_size=vocab)
    return MemoryPlan.merge([t_plan, d_plan])


# ---- building engines -----------------------------------------------------------------------


def _allocate(s: _Service, sp: ServicePlan, calibrate: bool = False):
    """The engine over its sized cache; with `calibrate`, its step costs timed (calibration.py)."""
    runner = make_runner(s.loaded, s.cfg, sp.num_blocks, s.k)
    if runner.kv.nbytes != sp.kv_cache_bytes:  # the plan's arithmetic and the tensor must agree
        raise RuntimeError(f"{s.name}: KV cache is {runner.kv.nbytes} bytes, the plan sized {sp.kv_cache_bytes}")
    engine_cls = TargetEngine if s.name == VERIFIER else DraftEngine
    engine = engine_cls(runner, s.cfg.max_prefill_tokens)
    if calibrate and s.name == VERIFIER and s.k > 0:
        engine.step_costs = calibrate_verifier(runner, s.k, s.cfg.max_num_seqs)
    elif calibrate and s.name == DRAFTER:
        engine.step_costs = calibrate_drafter(runner, s.cfg.max_num_seqs)
    return engine


def joint_costs(verifier, drafter, network_s: float = 0.0) -> StepCosts:
    """The verifier's and the drafter's calibrated costs as one StepCosts for the K policy."""
    v = getattr(verifier, "step_costs", None) or StepCosts()
    d = getattr(getattr(drafter, "model", drafter), "step_costs", None) or StepCosts()
    return StepCosts(verify=dict(v.verify), draft=dict(d.draft), network_s=network_s)


class ServiceBuild(NamedTuple):
    """One service's engine and the memory plan it was sized with: `engine, plan = build_...(cfg)`."""

    engine: TargetEngine | DraftEngine | NgramDrafter | HybridDrafter
    plan: MemoryPlan


def build_target_engine(cfg: EngineConfig, spec: SpecConfig = SpecConfig(), show_progress: bool = False) -> ServiceBuild:
    """The verifier service's engine on its own budget. spec.num_speculative_tokens sets the widest
    verification step the profile measures (k+1 tokens per sequence)."""
    t = _Service(VERIFIER, cfg, spec.num_speculative_tokens)
    plan = _plan_budget([t], show_progress, joint=False)
    plan.log()
    return ServiceBuild(_allocate(t, plan.services[VERIFIER], calibrate=spec.k_policy == "auto"), plan)


def _without_lookup(cfg: EngineConfig | None) -> tuple[EngineConfig | None, bool]:
    """A draft 'MODEL+ngram' is MODEL (what gets loaded, profiled and sized) plus prompt lookup."""
    if cfg is None:
        return None, False
    model, hybrid = split_draft_name(cfg.model)
    return (replace(cfg, model=model) if hybrid else cfg), hybrid


def _with_lookup(engine: DraftEngine, hybrid: bool, spec: SpecConfig) -> DraftEngine | HybridDrafter:
    # A feature drafter drafts as many tokens as the step asks (cheap, and accepted far more often
    # than the small model draft that --draft-model-tokens caps).
    model_tokens = 0 if isinstance(engine, FeatureDrafter) else spec.draft_model_tokens
    return HybridDrafter(engine, spec.ngram_min, spec.ngram_max, model_tokens) if hybrid else engine


def _draft_plan(cfg: EngineConfig, spec: SpecConfig, show_progress: bool, allocate: bool, vocab_size: int | None = None):
    cfg, hybrid = _without_lookup(cfg)
    if cfg.model == NGRAM:
        drafter = NgramDrafter(spec.ngram_min, spec.ngram_max, vocab_size, cfg.max_model_len) if allocate else None
        return drafter, _ngram_plan(cfg)
    if is_eagle3(cfg.model):
        plan = _ngram_plan(cfg)
        drafter = _with_lookup(_feature_drafter(cfg, spec, plan=plan), hybrid, spec) if allocate else None
        return drafter, plan
    d = _Service(DRAFTER, cfg, spec.num_speculative_tokens)
    if vocab_size is not None:
        d.after_load = _vocab_check(vocab_size)
    plan = _plan_budget([d], show_progress, joint=False)
    engine = _with_lookup(_allocate(d, plan.services[DRAFTER], calibrate=spec.k_policy == "auto"), hybrid, spec) if allocate else None
    return engine, plan


def build_draft_engine(cfg: EngineConfig, spec: SpecConfig = SpecConfig(), show_progress: bool = False,
                       vocab_size: int | None = None) -> ServiceBuild:
    """The drafter service's engine on its own budget: a DraftEngine, or the NgramDrafter (cfg.model
    'ngram', a plan of zeros). vocab_size, when known, is checked against the draft model's."""
    engine, plan = _draft_plan(cfg, spec, show_progress, allocate=True, vocab_size=vocab_size)
    plan.log()
    return ServiceBuild(engine, plan)


@dataclass
class Colocated:
    """Both engines in one process, behind the same SpecDecoder the gateway uses."""

    decoder: SpecDecoder
    target: TargetEngine
    drafter: DraftEngine | NgramDrafter | HybridDrafter | None
    target_model: LoadedModel
    draft_model: LoadedModel | None
    tokenizer: object
    plan: MemoryPlan | None = field(default=None)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.target_model.config.eos_token_ids

    def close(self) -> None:
        for seq_id in list(self.decoder.tracks):
            self.decoder.release([seq_id])


def build_colocated(
    target: EngineConfig,
    draft: EngineConfig | None,
    spec: SpecConfig = SpecConfig(),
    show_progress: bool = True,
) -> Colocated:
    """Target (+ draft) in this process. On one device the two share the target's budget flags.

    The tokenizer is loaded inside the measured window, so on CPU its memory is part of the
    verifier's non-torch bytes. target.extra["tensor_parallel_size"] > 1: a tensor-parallel
    target (specsplit.parallel.colocated)."""
    tp = int(target.extra.get("tensor_parallel_size", 1) or 1)
    if tp > 1:
        from specsplit.parallel.colocated import build_colocated_tp

        return build_colocated_tp(target, draft, spec, tp, show_progress)
    tokenizer = []
    draft, hybrid = _without_lookup(draft)
    plan, t, d = _plan_models(target, draft, spec, joint=True, show_progress=show_progress,
                              after_target=lambda loaded: tokenizer.append(load_tokenizer(loaded.hf_dir)))
    plan.log()
    calibrate = draft is not None and spec.k_policy == "auto" and spec.num_speculative_tokens > 0
    verifier = _allocate(t, plan.services[VERIFIER], calibrate)
    drafter = None
    if d is not None:
        drafter = _with_lookup(_allocate(d, plan.services[DRAFTER], calibrate), hybrid, spec)
    elif draft is not None and is_eagle3(draft.model):
        emb = t.loaded.model.embed_tokens
        # a GGUF target's quantized embedding is shared as the module (no dense fp32 copy)
        embedding = emb if getattr(emb, "quant", None) is not None else emb.weight
        drafter = _with_lookup(_feature_drafter(replace(draft, max_model_len=target.max_model_len), spec, embedding,
                                                t.loaded.config.num_layers, plan), hybrid, spec)
    elif draft is not None:
        drafter = NgramDrafter(spec.ngram_min, spec.ngram_max, t.loaded.config.vocab_size, target.max_model_len)
    decoder = SpecDecoder(verifier, drafter, spec if drafter else SpecConfig(num_speculative_tokens=0), target.max_model_len,
                          costs=joint_costs(verifier, drafter) if calibrate else None)
    return Colocated(decoder, verifier, drafter, t.loaded, d.loaded if d else None, tokenizer[0], plan)


def set_threads(num_threads: int | None) -> None:
    if num_threads:
        torch.set_num_threads(num_threads)
