"""Small frozen configuration dataclasses shared by the engines, services and CLI."""
from __future__ import annotations

from dataclasses import dataclass, field

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


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int = 0  # 0 = sized by the memory profiler
    dtype: torch.dtype = torch.float32


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 32
    max_model_len: int = 2048
    max_prefill_tokens: int = 512  # largest prefill chunk in one forward
    max_queue: int = 64  # waiting requests beyond max_num_seqs before RESOURCE_EXHAUSTED


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
    # Pre-draft the next step's likeliest branch while the verifier verifies this one
    # (specsplit/spec.py). The split gateway turns it on by default; in one process it needs the
    # drafter on its own core or device (`--async-draft`).
    async_draft: bool = False

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
    extra: dict = field(default_factory=dict, compare=False, hash=False)
