"""oneDNN-prepacked weights for bf16 linear layers on the CPU.

A plain bf16 `F.linear` on the CPU lets oneDNN reorder the weight into its blocked (AMX /
AVX512-BF16) layout on every call, which costs about as much as the matmul itself: a bf16 decode
step of SmolLM2-135M was slower than fp32 here. Reordering once at load time (what inductor's
weight freezing does) removes that, so a bf16 step reads half the bytes of an fp32 one.

The packed tensor is opaque (no storage the memory profiler's storage tracker can see), so each
packed weight reports its bytes through `untracked_bytes` and the loader adds them to the
service's weights. The results equal `F.linear` on the same bf16 tensors (checked in tests).
"""
from __future__ import annotations

import os

import torch

# A hint for the number of rows a call will see; 8 covers decode, verify (K+1) and small batches
# at full speed and stays within a few percent of the best layout for long prefill chunks.
ROWS_HINT = 8
ENV_SWITCH = "SPECSPLIT_CPU_PACK"  # "0" turns prepacking off (A/B benchmarks)


def supported(device: torch.device | str, dtype: torch.dtype) -> bool:
    """True where prepacking applies: CPU, bf16, a torch with oneDNN and a CPU with bf16 support."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return False
    if torch.device(device).type != "cpu" or dtype != torch.bfloat16:
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] bf16 dense -> the same weight in oneDNN's blocked layout (opaque)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), ROWS_HINT)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [T, in] bf16 -> [T, out] bf16 through a packed weight."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


def untracked_bytes(shape: torch.Size, dtype: torch.dtype) -> int:
    """Bytes a packed weight of this dense shape holds (the blocked layout has no padding for the
    shapes Llama-family models use; counting the dense size is what the budget needs)."""
    return int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
