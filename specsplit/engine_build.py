"""How one engine comes up, the steps every service shares: load the weights, run the profile's
largest steps, allocate the sized cache (and calibrate). specsplit.factory assembles services from
these; specsplit.parallel builds each tensor-parallel rank from them too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from specsplit.calibration import calibrate_drafter, calibrate_verifier
from specsplit.config import EngineConfig, drafter_reach
from specsplit.engine import DraftEngine, TargetEngine
from specsplit.kv.profiler import KVShape, ServicePlan
from specsplit.models.bounded_runner import BoundedRunner, ForwardBound
from specsplit.models.loader import LoadedModel, load_model
from specsplit.models.runner import ModelRunner
from specsplit.profile_run import make_profile_runner, profile_shapes, run_drafter_shape, run_verifier_shape

NGRAM = "ngram"
VERIFIER, DRAFTER = "verifier", "drafter"


def load_for(cfg: EngineConfig, show_progress: bool = True) -> LoadedModel:
    loaded = load_model(cfg.model, cfg.device, cfg.dtype, max_positions=cfg.max_model_len + 16, show_progress=show_progress,
                        weights=cfg.weights)
    if cfg.deterministic:  # --deterministic: batch-invariant numerics (models/deterministic.py)
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
        cap=cfg.kv_cap,
    )


def make_runner(loaded: LoadedModel, cfg: EngineConfig, num_blocks: int, num_speculative_tokens: int = 0) -> ModelRunner:
    return BoundedRunner(loaded.model, num_blocks, cfg.block_size, cfg.max_model_len, forward_bound(cfg, num_speculative_tokens))


# ---- measuring one budget's services ----------------------------------------------------------


@dataclass
class ModelService:
    """One model of a service while it is measured and sized: which, with what config and K."""

    name: str  # VERIFIER | DRAFTER
    cfg: EngineConfig
    k: int  # speculative tokens its steps carry (0: target-only)
    loaded: LoadedModel | None = None
    after_load: Callable[[LoadedModel], None] | None = None


def profile_steps(s: ModelService):
    model, cfg = s.loaded.model, s.cfg
    bound = forward_bound(cfg, s.k)
    engine_cls = TargetEngine if s.name == VERIFIER else DraftEngine
    run_shape = run_verifier_shape if s.name == VERIFIER else run_drafter_shape
    # A drafter keeps the q rows of its chain of drafts: K, or K + 1 + K while a gateway pre-drafts
    # (specsplit/spec/); the profile drafts the longer chain so its rows are in the plan.
    k = max(0, min(s.k if s.name == VERIFIER else drafter_reach(s.k, pre_draft=True), cfg.max_model_len - 2))

    def setup():
        return engine_cls(make_profile_runner(model, cfg.block_size, cfg.max_model_len, bound), bound.max_prefill_tokens)

    steps = {shape.name: (lambda eng, shape=shape: run_shape(eng, shape, k)) for shape in profile_shapes(bound, cfg.max_model_len)}
    return setup, steps


def allocate_engine(s: ModelService, sp: ServicePlan, calibrate: bool = False):
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
    runner.block_manager.prefix_caching = s.cfg.prefix_caching  # after calibration: its scratch prompts are not cached
    return engine
