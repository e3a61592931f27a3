"""Assemble engines from model arguments: load weights, size the KV cache, wire the decoder."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from specsplit.config import EngineConfig, SpecConfig
from specsplit.engine import DraftEngine, NgramDrafter, TargetEngine
from specsplit.models.loader import LoadedModel, load_model, load_tokenizer
from specsplit.models.runner import ModelRunner
from specsplit.spec import SpecDecoder

log = logging.getLogger(__name__)

NGRAM = "ngram"


def blocks_for_tokens(max_model_len: int, max_num_seqs: int, block_size: int, lookahead: int) -> int:
    """Blocks that let max_num_seqs sequences of max_model_len (+ lookahead) tokens run at once."""
    per_seq = -(-(max_model_len + lookahead) // block_size)
    return per_seq * max_num_seqs


def load_for(cfg: EngineConfig, show_progress: bool = True) -> LoadedModel:
    return load_model(cfg.model, cfg.device, cfg.dtype, max_positions=cfg.max_model_len + 16, show_progress=show_progress)


def make_runner(loaded: LoadedModel, cfg: EngineConfig, num_blocks: int) -> ModelRunner:
    return ModelRunner(loaded.model, num_blocks, cfg.block_size, cfg.max_model_len)


def check_model_len(loaded: LoadedModel, cfg: EngineConfig) -> None:
    limit = loaded.config.max_position_embeddings
    if cfg.max_model_len > limit:
        raise ValueError(f"--max-model-len {cfg.max_model_len} exceeds what {cfg.model} supports ({limit} positions)")


@dataclass
class Colocated:
    """Both engines in one process, behind the same SpecDecoder the gateway uses."""

    decoder: SpecDecoder
    target: TargetEngine
    drafter: DraftEngine | NgramDrafter | None
    target_model: LoadedModel
    draft_model: LoadedModel | None
    tokenizer: object

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
    lookahead = spec.num_speculative_tokens + 1
    target_model = load_for(target, show_progress)
    check_model_len(target_model, target)
    draft_model = None
    drafter = None
    if draft is not None and draft.model != NGRAM:
        draft_model = load_for(draft, show_progress)
        if draft_model.config.vocab_size != target_model.config.vocab_size:
            raise ValueError(
                f"draft vocabulary ({draft_model.config.vocab_size}) differs from the target's "
                f"({target_model.config.vocab_size}); they must share a tokenizer"
            )
    t_blocks = target.num_blocks or blocks_for_tokens(target.max_model_len, target.max_num_seqs, target.block_size, lookahead)
    verifier = TargetEngine(make_runner(target_model, target, t_blocks), target.max_prefill_tokens)
    if draft is not None:
        if draft.model == NGRAM:
            drafter = NgramDrafter(spec.ngram_min, spec.ngram_max, target_model.config.vocab_size, target.max_model_len)
        else:
            d_blocks = draft.num_blocks or blocks_for_tokens(draft.max_model_len, draft.max_num_seqs, draft.block_size, lookahead)
            drafter = DraftEngine(make_runner(draft_model, draft, d_blocks), draft.max_prefill_tokens)
    decoder = SpecDecoder(verifier, drafter, spec if drafter else SpecConfig(num_speculative_tokens=0), target.max_model_len)
    tokenizer = load_tokenizer(target_model.hf_dir)
    return Colocated(decoder, verifier, drafter, target_model, draft_model, tokenizer)


def set_threads(num_threads: int | None) -> None:
    if num_threads:
        torch.set_num_threads(num_threads)
