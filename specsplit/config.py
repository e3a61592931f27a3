"""Small frozen configuration dataclasses shared by the engines, services and CLI."""
from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of fp32, bf16, fp16") from None


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder (Llama, Mistral, Qwen2)."""

    architecture: str  # "llama" | "mistral" | "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, object], ...] | None = None  # frozen dict items
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has bias on q, k, v
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def rope_scaling_dict(self) -> dict | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V for one token across all layers."""
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem


def step_k_cap(k: int, tokens: int, max_model_len: int, budget: int | None = None) -> int:
    """Drafts a sequence holding `tokens` tokens may verify in one step: at most k, so that its
    drafts and the one token the step emits fit in max_model_len and in `budget`, the tokens it may
    still emit (None: unbounded). The step (specsplit.spec) and the scheduler's KV reservation
    (specsplit.scheduler) both ask this."""
    cap = min(k, max_model_len - tokens - 1)
    if budget is not None:
        cap = min(cap, budget - 1)
    return max(0, cap)


def drafter_reach(k: int, pre_draft: bool) -> int:
    """Positions past its tokens a drafter holds in one step for k drafts: the k, or while it
    pre-drafts (specsplit.spec) the branch past them too: the bonus token's guess and k more."""
    return 2 * k + 1 if pre_draft else k


@dataclass(frozen=True)
class SpecConfig:
    num_speculative_tokens: int = 4
    disable_by_batch_size: int = 0  # 0 = never disable
    ngram_min: int = 1
    ngram_max: int = 4
    # MODEL+ngram: the model drafts at most this many of the K tokens (prompt lookup drafts up to
    # K); 0 = K. A weak draft model pays off only at small K while lookup runs stay long.
    draft_model_tokens: int = 1
    # "auto": K per step from calibrated costs and online acceptance (specsplit/k_policy.py), with
    # num_speculative_tokens as the maximum; "fixed": always num_speculative_tokens. The servers
    # and `specsplit generate` default to auto (--k-policy); a library caller asks for it.
    k_policy: str = "fixed"
    # --draft suffix / MODEL+suffix (specsplit/suffix_drafter.py): finished outputs the drafter keeps
    # to draft from (tokens), and whether requests share them ("finished") or not ("none").
    suffix_cache_tokens: int = 1 << 18  # = defaults.DEFAULT_SUFFIX_CACHE_TOKENS (defaults imports config)
    suffix_share: str = "finished"
    # Pre-draft the next step's likeliest branch while the verifier verifies this one
    # (specsplit/spec/). The split gateway turns it on by default; in one process it needs the
    # drafter on its own core or device (`--async-draft`).
    async_draft: bool = False
    # Tree verification (specsplit/draft_tree.py): the most branch nodes a greedy sequence's drafts
    # may add to their chain each step (0 = chains only). With the auto K policy the calibrated
    # verify cost sizes it (k_policy.tree_nodes), 0 included. Lockstep only (not with async_draft).
    tree_nodes: int = 0
    # A feature drafter (EAGLE-3 head) ends a greedy chain before the draft at which the product of
    # its top-1 probabilities so far falls below this (it always drafts one): where the head is
    # unsure, a draft would cost a verify row it rarely repays. 0 = always the step's K. The
    # servers' default: defaults.DEFAULT_DRAFT_STOP (--draft-stop).
    draft_stop: float = 0.0

    def enabled_for(self, num_running: int) -> bool:
        if self.num_speculative_tokens <= 0:
            return False
        return self.disable_by_batch_size <= 0 or num_running <= self.disable_by_batch_size


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine needs to come up: which model, where, how big its cache may be."""

    model: str
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    weights: str = "native"  # a GGUF model's weights: "native" (its quantized blocks), "fp32", "bf16" (dense)
    block_size: int = 16
    max_model_len: int = 2048
    max_num_seqs: int = 32
    max_prefill_tokens: int = 512
    num_blocks: int = 0  # 0 = sized by the memory profiler from the budget
    memory_budget_bytes: int | None = None
    memory_utilization: float = 0.9
    # --tensor-parallel-size: ranks the target is sharded over (specsplit.parallel); 1 = one process
    tensor_parallel_size: int = 1
    # --deterministic: batch-invariant numerics (models/deterministic.py); the target's only
    deterministic: bool = False
    # --prefix-caching: reuse the KV blocks of prompt prefixes computed before (kv/block_manager.py)
    prefix_caching: bool = True
    # False: the KV cache is sized from the memory budget alone, not capped at what max_num_seqs
    # sequences of max_model_len can use (the profiler's tests make the budget bind)
    kv_cap: bool = True
