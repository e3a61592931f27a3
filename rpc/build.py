"""Build one engine for a drafter or verifier service from its command-line arguments, and
describe its memory plan.

The colocated server uses specsplit.factory.build_colocated instead (one joint budget); a split
service sizes its own cache with the memory profiler (specsplit.factory.build_target_engine /
build_draft_engine), and reports that plan's to_dict().
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from specsplit.defaults import DEFAULT_K_NGRAM, DEFAULT_K_POLICY, engine_config
from specsplit.config import EngineConfig, SpecConfig
from specsplit.factory import build_draft_engine, build_target_engine
from specsplit.engine import DraftEngine
from specsplit.factory import grammar_compiler, without_lookup
from specsplit.models.loader import hf_dir_for, load_tokenizer

log = logging.getLogger(__name__)


@dataclass
class BuiltEngine:
    engine: object  # TargetEngine | DraftEngine | NgramDrafter
    cfg: EngineConfig
    lookahead: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    tokenizer_dir: str
    plan: dict

    @property
    def plan_json(self) -> str:
        return json.dumps(self.plan, sort_keys=True)


def plan_to_dict(obj) -> dict | None:
    """The memory profiler's plan attached to obj (a Colocated, an engine), if any."""
    for attr in ("memory_plan", "plan"):
        plan = getattr(obj, attr, None)
        if plan is not None and hasattr(plan, "to_dict"):
            return plan.to_dict()
    return None


def static_plan(engine, cfg: EngineConfig, lookahead: int) -> dict:
    runner = getattr(engine, "runner", None)
    if runner is None:
        return {"source": "none", "kv_cache": False, "note": "the n-gram proposer keeps no KV cache"}
    bm = runner.block_manager
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    return {
        "source": "static",
        "note": "KV sized for max_num_seqs sequences of max_model_len + lookahead tokens",
        "device": str(cfg.device),
        "dtype": str(cfg.dtype).replace("torch.", ""),
        "weights_bytes": int(weights),
        "kv_bytes": int(runner.kv.nbytes),
        "num_blocks": bm.num_blocks,
        "block_size": bm.block_size,
        "kv_tokens": bm.num_blocks * bm.block_size,
        "max_num_seqs": cfg.max_num_seqs,
        "max_model_len": cfg.max_model_len,
        "lookahead": lookahead,
    }


def _spec(args) -> SpecConfig:
    """The K a service is sized for: --num-speculative-tokens, else the largest default (n-gram's)."""
    k = args.num_speculative_tokens
    return SpecConfig(num_speculative_tokens=DEFAULT_K_NGRAM if k is None else k,
                      draft_model_tokens=getattr(args, "draft_model_tokens", SpecConfig.draft_model_tokens),
                      k_policy=getattr(args, "k_policy", None) or DEFAULT_K_POLICY,
                      suffix_cache_tokens=getattr(args, "suffix_cache_tokens", SpecConfig.suffix_cache_tokens),
                      suffix_share=getattr(args, "suffix_share", SpecConfig.suffix_share))


def build_engine(args, role: str) -> BuiltEngine:
    """role 'verifier' -> TargetEngine; 'drafter' -> DraftEngine, or NgramDrafter for --model ngram.
    Each is sized by the memory profiler on the service's own budget (specsplit.factory)."""
    spec = _spec(args)
    lookahead = spec.num_speculative_tokens + 1
    cfg = engine_config(args, args.model)
    tp = getattr(args, "tensor_parallel_size", 1) or 1
    if role == "verifier" and tp > 1:  # rank 0 here, N-1 supervised workers (specsplit.parallel)
        from specsplit.parallel.group import TPGroup

        _, engine, plan = TPGroup.launch(cfg, spec, tp, threads=getattr(args, "threads", 0))
        plan.log()
    elif role == "verifier":  # its grammar compiler built at start-up, inside its memory plan
        engine, plan = build_target_engine(cfg, spec, grammars=True, grammar_timeout=getattr(args, "grammar_timeout", None))
    else:
        engine, plan = build_draft_engine(cfg, spec)
    plan_dict = plan.to_dict() if plan is not None else static_plan(engine, cfg, lookahead)
    runner = getattr(engine, "runner", None)
    if runner is None:  # the n-gram proposer, a feature drafter
        return BuiltEngine(engine, cfg, lookahead, 0, (), "", plan_dict)
    mcfg = runner.model.cfg
    tokenizer_dir = str(hf_dir_for(cfg.model, show_progress=False)) if role == "verifier" else ""
    model_drafter = getattr(engine, "model", engine)  # MODEL+ngram: the model part
    if role == "drafter" and isinstance(model_drafter, DraftEngine):  # masks its drafts (best effort)
        draft_dir = hf_dir_for(without_lookup(cfg)[0].model, show_progress=False)  # the model, not MODEL+ngram
        # (no --grammar-timeout: a drafter never waits for a compile, engine.DraftGrammar)
        model_drafter.grammars = grammar_compiler(lambda: load_tokenizer(draft_dir), mcfg)
    if role == "verifier" and getattr(engine, "grammars", False) is None:  # tensor parallel: the tokenizer loads when a grammar first comes
        engine.grammars = grammar_compiler(lambda: load_tokenizer(tokenizer_dir), mcfg,
                                           getattr(args, "grammar_timeout", None))
    return BuiltEngine(engine, cfg, lookahead, mcfg.vocab_size, tuple(mcfg.eos_token_ids), tokenizer_dir, plan_dict)
