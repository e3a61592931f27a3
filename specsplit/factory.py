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

import json
import logging
from dataclasses import dataclass, field, replace
from typing import Callable, NamedTuple

import torch

from specsplit.calibration import StepCosts
from specsplit.config import EngineConfig, SpecConfig
from specsplit.engine import DraftEngine, NgramDrafter, TargetEngine
from specsplit.engine_build import (DRAFTER, NGRAM, VERIFIER, ModelService, allocate_engine, check_model_len, kv_shape,
                                    load_for, profile_steps)
from specsplit.feature_drafter import (FeatureDrafter, calibrate_feature_drafter, embedding_bytes, linear_kind,
                                      load_feature_drafter)
from specsplit.hybrid_drafter import FEATURE_NGRAM_MIN, HybridDrafter
from specsplit.suffix_drafter import SuffixDrafter
from specsplit.kv.meters import rss_bytes, tensor_storage_bytes
from specsplit.kv.profiler import MemoryPlan, MemoryProfiler, ServicePlan, fmt_bytes
from specsplit.models.gguf_native import QuantEmbedding
from specsplit.models.loader import LoadedModel, load_tokenizer
from specsplit.sampling.grammar import GrammarCompiler
from specsplit.models.registry import LOOKUPS, is_eagle3, split_draft_name
from specsplit.spec import SpecDecoder

log = logging.getLogger(__name__)


@dataclass
class HeadService:
    """An EAGLE-3 head colocated with its target on one budget: loaded after the target (it reads
    the target's embedding), measured like a model (its weights, packed copies included) and its
    KV caches counted at their bound (max_num_seqs x max_model_len rows), all before the
    verifier's KV cache is sized from what is left. cfg: the draft's config at the target's
    max_model_len and max_num_seqs."""

    cfg: EngineConfig
    drafter: FeatureDrafter | None = None

    def load(self, prof: MemoryProfiler, target: LoadedModel) -> None:
        emb = target.model.embed_tokens
        # a GGUF target's quantized embedding is shared as the module (no dense fp32 copy)
        embedding = emb if isinstance(emb, QuantEmbedding) else emb.weight
        c = self.cfg
        self.drafter = prof.load(DRAFTER, lambda: load_feature_drafter(c.model, c.max_model_len, c.device, c.dtype, embedding,
                                                                        target.config.num_layers))
        prof.reserve(DRAFTER, self.drafter.cache_bound_bytes(c.max_num_seqs))


def _plan_budget(services: list[ModelService], show_progress: bool, joint: bool,
                 after_loads: Callable[[list[ModelService]], None] | None = None,
                 head: HeadService | None = None) -> MemoryPlan:
    """Load, profile and size services that share one budget (set by the first one's flags); an
    EAGLE-3 head on the same budget (colocated) is loaded and counted before the sizing."""
    lead = services[0].cfg
    prof = MemoryProfiler(lead.device, lead.memory_budget_bytes, lead.memory_utilization, joint=joint)
    for s in services:
        s.loaded = prof.load(s.name, lambda s=s: load_for(s.cfg, show_progress))
        check_model_len(s.loaded, s.cfg)
        if s.after_load is not None:
            s.after_load(s.loaded)
    if after_loads is not None:
        after_loads(services)
    if head is not None:
        head.load(prof, services[0].loaded)
    for s in services:
        setup, steps = profile_steps(s)
        prof.profile(s.name, setup, steps)
    models = {s.name: s.cfg.model for s in services}
    dtypes = {s.name: s.cfg.dtype for s in services}
    if head is not None:
        models[DRAFTER], dtypes[DRAFTER] = head.cfg.model, head.cfg.dtype
    plan = prof.plan({s.name: kv_shape(s.loaded, s.cfg) for s in services}, models=models, dtypes=dtypes)
    for s in services:
        plan.services[s.name].weights = s.loaded.weights
    return plan


def _ngram_plan(cfg: EngineConfig | None) -> MemoryPlan:
    device = str(torch.device(cfg.device)) if cfg is not None else "cpu"
    model = cfg.model if cfg is not None and (is_eagle3(cfg.model) or cfg.model in LOOKUPS) else NGRAM
    return MemoryPlan(joint=False, budget_bytes=0, services={DRAFTER: ServicePlan.zeros(DRAFTER, model, device)})


def _service_head(cfg: EngineConfig, spec: SpecConfig, plan: MemoryPlan, calibrate: bool = True) -> FeatureDrafter:
    """A drafter service's EAGLE-3 head: loaded with its own grammar compiler (in the target's
    vocabulary), its weights (the head's and the target's embedding it reads, its own here), KV
    bound and compiler recorded in `plan`'s drafter row. calibrate=False: for the plan alone
    (`specsplit profile`), no K-policy costs."""
    drafter = load_feature_drafter(cfg.model, cfg.max_model_len, cfg.device, cfg.dtype)
    compiler_bytes = 0
    drafter.grammars = feature_grammars(cfg.model)
    if drafter.grammars is not None:
        compiler_bytes = _warm_grammars(drafter.grammars, f"feature drafter {cfg.model}")
    row = plan.services[DRAFTER]
    head_bytes, emb_bytes = tensor_storage_bytes(drafter.head), embedding_bytes(drafter.embedding)
    row.weights_bytes = head_bytes + emb_bytes
    emb = drafter.embedding
    emb_kind = emb.quant.qtype if isinstance(emb, QuantEmbedding) else str(emb.dtype).replace("torch.", "")
    row.weights = (f"head {fmt_bytes(head_bytes)} ({linear_kind(drafter.head.midlayer.qkv_proj)}), "
                   f"the target's embedding {fmt_bytes(emb_bytes)} ({emb_kind})")
    row.activation_peak_bytes = drafter.cache_bound_bytes(cfg.max_num_seqs)
    row.non_torch_bytes += compiler_bytes
    row.dtype = str(cfg.dtype).replace("torch.", "")
    return _ready_head(drafter, cfg, spec) if calibrate else drafter


def _ready_head(drafter: FeatureDrafter, cfg: EngineConfig, spec: SpecConfig) -> FeatureDrafter:
    """A loaded EAGLE-3 head (a drafter service's, or a colocated one from HeadService) calibrated
    for the K policy, with the chain's stop threshold."""
    if spec.k_policy == "auto" and spec.num_speculative_tokens > 0:
        drafter.step_costs = calibrate_feature_drafter(drafter, cfg.max_num_seqs)
    drafter.stop_below = spec.draft_stop
    return drafter


def _warm_grammars(grammars: GrammarCompiler, who: str) -> int:
    """A split service's compiler built before it serves. On the drafter, loading the tokenizer on
    the first grammar request took 2-4 s of a split stack's drafting (it shares the GIL and the cores
    with the drafting thread, and the gateway marked the drafter late); on the verifier the first
    structured request waited for it. -> the host memory it took (RSS growth, for the memory plan's
    non-torch bytes)."""
    before = rss_bytes()
    try:
        seconds = grammars.warm()
    except Exception as e:  # noqa: BLE001 - the first grammar tries again (and logs) on its compile thread
        log.warning("%s: the structured-output compiler did not build now (%s); the first grammar request "
                    "builds it", who, e)
        return 0
    grown = max(0, rss_bytes() - before)
    log.info("%s: structured-output compiler ready in %.1f s (the target's tokenizer), %s of host memory "
             "(counted in the memory plan)", who, seconds, fmt_bytes(grown))
    return grown


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
                 after_target: Callable[[LoadedModel], None] | None = None
                 ) -> tuple[MemoryPlan, ModelService, ModelService | None, HeadService | None]:
    """Measure and size target (+ draft model, or + EAGLE-3 head): one budget on a shared device
    when joint, else one each. A joint head is loaded here (HeadService.drafter)."""
    draft, _ = without_lookup(draft)  # MODEL+ngram: prompt lookup needs no memory of its own
    has_draft = draft is not None and draft.model not in LOOKUPS and not is_eagle3(draft.model)
    head = None
    if joint and draft is not None and is_eagle3(draft.model):
        head = HeadService(replace(draft, device=target.device, max_model_len=target.max_model_len,
                                   max_num_seqs=target.max_num_seqs))
    k = spec.num_speculative_tokens if draft is not None else 0
    t = ModelService(VERIFIER, target, k, after_load=after_target)
    d = ModelService(DRAFTER, draft, k) if has_draft else None
    if d is not None and joint and _same_device(target, draft):
        def check(services):
            _vocab_check(services[0].loaded.config.vocab_size)(services[1].loaded)

        plan = _plan_budget([t, d], show_progress, joint=True, after_loads=check)
        return plan, t, d, None
    # Target alone on its budget (with its head); with the n-gram drafter (no memory) that budget
    # is still the joint one.
    t_plan = _plan_budget([t], show_progress, joint=joint and d is None and draft is not None, head=head)
    if d is None:
        plan = _with_drafter_zeros(t_plan, draft) if draft is not None and head is None else t_plan
        return plan, t, None, head
    d.after_load = _vocab_check(t.loaded.config.vocab_size)
    d_plan = _plan_budget([d], show_progress, joint=False)
    return MemoryPlan.merge([t_plan, d_plan]), t, d, None


def grammar_compiler(tokenizer, config, timeout_s: float | None = None) -> GrammarCompiler:
    """The verifier's compiler of structured-output grammars: the target's tokenizer (or a callable
    that loads it on first use), its logits width and EOS ids (the tokens that end an output);
    timeout_s: --grammar-timeout (None: the default)."""
    return GrammarCompiler(tokenizer, config.vocab_size, tuple(config.eos_token_ids),
                           **({} if timeout_s is None else {"timeout_s": timeout_s}))


def share_grammars(drafter, grammars: GrammarCompiler | None) -> None:
    """Colocated: the drafter's model part (a DraftEngine or an EAGLE-3 head, behind prompt lookup
    too) drafts from the grammar's mask with the verifier's compiler (one compiler, one cache)."""
    model = getattr(drafter, "model", drafter)
    if grammars is not None and isinstance(model, (DraftEngine, FeatureDrafter)):
        model.grammars = grammars


def feature_grammars(head: str) -> GrammarCompiler | None:
    """The compiler an EAGLE-3 head masks its drafts with where it has no verifier beside it (a
    drafter service): the head drafts in its target's vocabulary, so grammars compile with the
    target's tokenizer and config, read from the head's `specsplit_base_model` (the config now, the
    tokenizer when a grammar first comes, as the verifier service does). None, logged, where the
    base model cannot be read: the head drafts unmasked and the verifier cuts."""
    from specsplit.feature_drafter import base_model
    from specsplit.models.loader import hf_dir_for, model_config_from_hf

    try:
        base = base_model(head)
        if not base:
            raise ValueError("its config.json names no specsplit_base_model")
        hf_dir = hf_dir_for(base, show_progress=False)
        config = model_config_from_hf(json.loads((hf_dir / "config.json").read_text()))
    except Exception as e:  # noqa: BLE001 - best effort: the mask is an optimization on a drafter
        log.warning("feature drafter %s: no structured-output compiler (drafts unmasked, the verifier cuts): %s",
                    head, e)
        return None
    return grammar_compiler(lambda: load_tokenizer(hf_dir), config)  # no timeout: a drafter never waits


def plan_memory(target: EngineConfig, draft: EngineConfig | None = None, spec: SpecConfig = SpecConfig(),
                colocated: bool = True, show_progress: bool = False) -> MemoryPlan:
    """The plan the services would start with, without allocating a KV cache (`specsplit profile`).

    colocated: both models in one process, one joint budget when they share a device. Otherwise
    each service on its own budget and device, measured one after the other.
    """
    if colocated:  # as build_colocated: the tokenizer is in the window too
        plan, _, _, _ = _plan_models(target, draft, spec, joint=True, show_progress=show_progress,
                                  after_target=lambda loaded: load_tokenizer(loaded.hf_dir))
        return plan
    # As the separate services would start: the verifier sized for k drafts, then the drafter.
    t = ModelService(VERIFIER, target, spec.num_speculative_tokens if draft is not None else 0)
    t_plan = _plan_budget([t], show_progress, joint=False)
    if draft is None:
        return t_plan
    vocab = t.loaded.config.vocab_size
    t.loaded = None  # a separate process would not hold the target
    _, d_plan = draft_engine_and_plan(draft, spec, show_progress, allocate=False, vocab_size=vocab)
    return MemoryPlan.merge([t_plan, d_plan])


# ---- building engines -----------------------------------------------------------------------


def colocated_decoder(verifier, drafter, spec: SpecConfig, max_model_len: int) -> SpecDecoder:
    """The SpecDecoder of both colocated modes (one device, tensor parallel): with the K policy on,
    priced from both engines' calibrated costs; without a drafter, target-only."""
    if drafter is None:
        return SpecDecoder(verifier, None, SpecConfig(num_speculative_tokens=0), max_model_len)
    auto = spec.k_policy == "auto" and spec.num_speculative_tokens > 0
    return SpecDecoder(verifier, drafter, spec, max_model_len, costs=joint_costs(verifier, drafter) if auto else None)


def joint_costs(verifier, drafter, network_s: float = 0.0) -> StepCosts:
    """The verifier's and the drafter's calibrated costs as one StepCosts for the K policy."""
    v = verifier.step_costs or StepCosts()
    d = (drafter.step_costs if drafter is not None else None) or StepCosts()
    return StepCosts(verify=dict(v.verify), draft=dict(d.draft), network_s=network_s, spread=v.spread)


class ServiceBuild(NamedTuple):
    """One service's engine and the memory plan it was sized with: `engine, plan = build_...(cfg)`."""

    engine: TargetEngine | DraftEngine | NgramDrafter | HybridDrafter
    plan: MemoryPlan


def build_target_engine(cfg: EngineConfig, spec: SpecConfig = SpecConfig(), show_progress: bool = False,
                        grammars: bool = False, grammar_timeout: float | None = None) -> ServiceBuild:
    """The verifier service's engine on its own budget. spec.num_speculative_tokens sets the widest
    verification step the profile measures (k+1 tokens per sequence).

    grammars: give it its structured-output compiler (the target's tokenizer; grammar_timeout:
    --grammar-timeout), built after the model loads and before the profile run, so the host memory
    it takes (~120 MiB for SmolLM2's tokenizer and xgrammar) is in the plan's non-torch bytes and
    the first structured request does not wait ~2 s for it."""
    compilers: list[GrammarCompiler] = []

    def warm(loaded: LoadedModel) -> None:
        compilers.append(grammar_compiler(lambda: load_tokenizer(loaded.hf_dir), loaded.config, grammar_timeout))
        _warm_grammars(compilers[0], f"verifier {cfg.model}")

    t = ModelService(VERIFIER, cfg, spec.num_speculative_tokens, after_load=warm if grammars else None)
    plan = _plan_budget([t], show_progress, joint=False)
    plan.log()
    engine = allocate_engine(t, plan.services[VERIFIER], calibrate=spec.k_policy == "auto")
    if compilers:
        engine.grammars = compilers[0]
    return ServiceBuild(engine, plan)


def lookup_drafter(name: str, spec: SpecConfig, vocab_size: int | None, max_model_len: int):
    """A drafter with no model: 'ngram' (prompt lookup) or 'suffix' (specsplit/suffix_drafter.py)."""
    if name == "suffix":
        drafter = SuffixDrafter(vocab_size, max_model_len, spec.suffix_cache_tokens, spec.suffix_share)
        log.info("%s", drafter.describe())
        return drafter
    return NgramDrafter(spec.ngram_min, spec.ngram_max, vocab_size, max_model_len)


def without_lookup(cfg: EngineConfig | None) -> tuple[EngineConfig | None, str | None]:
    """A draft 'MODEL+ngram' / 'MODEL+suffix' is MODEL (what gets loaded, profiled and sized) plus
    a lookup ('ngram' / 'suffix'; None: no lookup)."""
    if cfg is None:
        return None, None
    model, hybrid = split_draft_name(cfg.model)
    return (replace(cfg, model=model) if hybrid else cfg), hybrid


def with_lookup(engine: DraftEngine, hybrid: str | None, spec: SpecConfig) -> DraftEngine | HybridDrafter:
    if not hybrid:
        return engine
    # A feature drafter drafts as many tokens as the step asks (cheap, and accepted far more often
    # than the small model draft that --draft-model-tokens caps).
    feature = isinstance(engine, FeatureDrafter)
    model_tokens = 0 if feature else spec.draft_model_tokens
    # ... and is right more often than a short prompt-lookup match (hybrid_drafter.FEATURE_NGRAM_MIN)
    ngram_min = max(spec.ngram_min, FEATURE_NGRAM_MIN) if feature else spec.ngram_min
    suffix = lookup_drafter("suffix", spec, engine.vocab_size, engine.max_model_len) if hybrid == "suffix" else None
    return HybridDrafter(engine, ngram_min, max(spec.ngram_max, ngram_min), model_tokens, suffix=suffix)


def draft_engine_and_plan(cfg: EngineConfig, spec: SpecConfig, show_progress: bool, allocate: bool, vocab_size: int | None = None):
    cfg, hybrid = without_lookup(cfg)
    if cfg.model in LOOKUPS:
        drafter = lookup_drafter(cfg.model, spec, vocab_size, cfg.max_model_len) if allocate else None
        plan = _ngram_plan(cfg)
        if cfg.model == "suffix" and spec.suffix_share != "none":
            # the shared cache at its bound: 8 bytes a token in the array, 8 per occurrence in the index
            plan.services[DRAFTER].non_torch_bytes = 16 * spec.suffix_cache_tokens
        return drafter, plan
    if is_eagle3(cfg.model):
        plan = _ngram_plan(cfg)
        head = _service_head(cfg, spec, plan, calibrate=allocate)  # loaded for the plan's numbers either way
        return (with_lookup(head, hybrid, spec) if allocate else None), plan
    d = ModelService(DRAFTER, cfg, spec.num_speculative_tokens)
    if vocab_size is not None:
        d.after_load = _vocab_check(vocab_size)
    plan = _plan_budget([d], show_progress, joint=False)
    engine = with_lookup(allocate_engine(d, plan.services[DRAFTER], calibrate=spec.k_policy == "auto"), hybrid, spec) if allocate else None
    return engine, plan


def build_draft_engine(cfg: EngineConfig, spec: SpecConfig = SpecConfig(), show_progress: bool = False,
                       vocab_size: int | None = None) -> ServiceBuild:
    """The drafter service's engine on its own budget: a DraftEngine, or the NgramDrafter (cfg.model
    'ngram', a plan of zeros). vocab_size, when known, is checked against the draft model's."""
    engine, plan = draft_engine_and_plan(cfg, spec, show_progress, allocate=True, vocab_size=vocab_size)
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
    verifier's non-torch bytes. target.tensor_parallel_size > 1: a tensor-parallel
    target (_build_colocated_tp)."""
    tp = max(1, int(target.tensor_parallel_size))
    if tp > 1:
        return _build_colocated_tp(target, draft, spec, tp, show_progress)
    tokenizer = []
    draft, hybrid = without_lookup(draft)
    plan, t, d, head = _plan_models(target, draft, spec, joint=True, show_progress=show_progress,
                              after_target=lambda loaded: tokenizer.append(load_tokenizer(loaded.hf_dir)))
    plan.log()
    calibrate = draft is not None and spec.k_policy == "auto" and spec.num_speculative_tokens > 0
    verifier = allocate_engine(t, plan.services[VERIFIER], calibrate)
    verifier.grammars = grammar_compiler(tokenizer[0], t.loaded.config)
    drafter = None
    if d is not None:
        drafter = with_lookup(allocate_engine(d, plan.services[DRAFTER], calibrate), hybrid, spec)
    elif head is not None:  # an EAGLE-3 head, loaded and counted in the joint plan
        drafter = with_lookup(_ready_head(head.drafter, head.cfg, spec), hybrid, spec)
    elif draft is not None:
        drafter = lookup_drafter(draft.model, spec, t.loaded.config.vocab_size, target.max_model_len)
    share_grammars(drafter, verifier.grammars)
    decoder = colocated_decoder(verifier, drafter, spec, target.max_model_len)
    return Colocated(decoder, verifier, drafter, t.loaded, d.loaded if d else None, tokenizer[0], plan)


def _build_colocated_tp(target: EngineConfig, draft: EngineConfig | None, spec: SpecConfig, world: int,
                       show_progress: bool = False):
    """`specsplit serve --tensor-parallel-size N`: the target comes up as in the verifier service
    (rank 0 in this process, N-1 supervised workers, one plan per rank); the draft, if any, is
    loaded in this process on its own budget after the target. This is the one place the colocated
    mode does not plan one joint budget: the target's ranks are sized first (on the CPU each gets
    1/N of the host's budget), then the draft on the budget flags again. The drafter stays at one
    rank; the decoder is assembled as on one device (colocated_decoder)."""
    from specsplit.parallel.build import TPMemoryPlan
    from specsplit.parallel.group import TPGroup

    k = spec.num_speculative_tokens if draft is not None else 0
    group, verifier, t_plan = TPGroup.launch(target, replace(spec, num_speculative_tokens=k), world,
                                             threads=torch.get_num_threads(), show_progress=show_progress)
    try:
        loaded = group.loaded
        tokenizer = load_tokenizer(loaded.hf_dir)
        if hasattr(verifier, "grammars"):
            verifier.grammars = grammar_compiler(tokenizer, loaded.config)
        drafter, d_plan = None, None
        if draft is not None:
            base, _ = without_lookup(draft)
            if base.model in LOOKUPS:
                drafter = lookup_drafter(base.model, spec, loaded.config.vocab_size, target.max_model_len)
            else:
                drafter, d_plan = draft_engine_and_plan(draft, spec, show_progress, allocate=True, vocab_size=loaded.config.vocab_size)
                share_grammars(drafter, getattr(verifier, "grammars", None))
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


def set_threads(num_threads: int | None) -> None:
    if num_threads:
        torch.set_num_threads(num_threads)
