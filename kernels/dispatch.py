"""The one place that decides between the Triton kernels and their torch references.

    use_triton(device) -> bool
        auto (default): True on CUDA when triton imports, False on CPU.
        SPECSPLIT_KERNELS=torch  forces the torch references everywhere.
        SPECSPLIT_KERNELS=triton forces the kernels; on CPU that needs TRITON_INTERPRET=1 set
        before the process imports triton (the kernels then run in Triton's interpreter).

The engine calls the functions below whatever the backend; each routes on the device of its main
tensor. Kernel modules are imported lazily, only when a Triton path is taken, so a CPU-only
process never imports triton.
"""

from __future__ import annotations

import functools
import importlib
import os
from typing import Sequence

import torch

from specsplit.kernels import decode_ops

ENV_VAR = "SPECSPLIT_KERNELS"
_MODES = ("auto", "torch", "triton")


@functools.lru_cache(maxsize=1)
def triton_import_error() -> str | None:
    """None when triton imports, else why not (cached: importability does not change)."""
    try:
        importlib.import_module("triton")
    except Exception as exc:  # ImportError, or a broken install raising something else
        return f"{type(exc).__name__}: {exc}"
    return None


def _interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def kernel_mode() -> str:
    mode = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if mode not in _MODES:
        raise ValueError(f"{ENV_VAR}={mode!r} is not one of {', '.join(_MODES)}")
    return mode


def use_triton(device: torch.device | str) -> bool:
    device = torch.device(device)
    mode = kernel_mode()
    if mode == "torch":
        return False
    if mode == "auto":
        return device.type == "cuda" and triton_import_error() is None
    # forced triton
    error = triton_import_error()
    if error is not None:
        raise RuntimeError(
            f"{ENV_VAR}=triton but triton cannot be imported ({error}); "
            f"install specsplit[triton] or set {ENV_VAR}=torch"
        )
    if device.type == "cpu" and not _interpreter_on():
        raise RuntimeError(
            f"{ENV_VAR}=triton on a CPU tensor needs Triton's interpreter: set "
            f"TRITON_INTERPRET=1 in the environment before the process starts "
            f"(or set {ENV_VAR}=torch)"
        )
    if device.type not in ("cpu", "cuda"):
        raise RuntimeError(f"{ENV_VAR}=triton: no Triton backend for device type {device.type!r}")
    return True


def backend_name(device: torch.device | str) -> str:
    return "triton" if use_triton(device) else "torch"


# ---------------------------------------------------------------------------------------------
# host-level operations the engine calls
# ---------------------------------------------------------------------------------------------


def greedy_rejection(
    draft_ids: torch.Tensor,  # [B, K] int64
    num_draft: torch.Tensor,  # [B] int64
    target_argmax: torch.Tensor,  # [B, K+1] int64
) -> tuple[torch.Tensor, torch.Tensor]:  # num_accepted [B] int64, out_ids [B, K+1] (-1 pad)
    if use_triton(target_argmax.device):
        from specsplit.kernels.rejection_greedy import greedy_rejection_triton

        return greedy_rejection_triton(draft_ids, num_draft, target_argmax)
    from specsplit.kernels.reference import greedy_rejection_ref

    return greedy_rejection_ref(draft_ids, num_draft, target_argmax)


def random_accept(
    draft_ids: torch.Tensor,  # [B, K] int64
    draft_q: torch.Tensor,  # [B, K] float32, q(x) of each drafted id
    num_draft: torch.Tensor,  # [B] int64
    target_probs: torch.Tensor,  # [B, K+1, V] float32
    u_accept: torch.Tensor,  # [B, K] float64
) -> torch.Tensor:  # num_accepted [B] int64
    if use_triton(target_probs.device):
        from specsplit.kernels.rejection_random import random_accept_triton

        return random_accept_triton(draft_ids, draft_q, num_draft, target_probs, u_accept)
    from specsplit.kernels.reference import random_accept_ref

    return random_accept_ref(draft_ids, draft_q, num_draft, target_probs, u_accept)


def random_finish(
    target_probs_row: torch.Tensor,  # [B, V] float32, p at each row's stop position
    draft_q_row: torch.Tensor | Sequence[torch.Tensor | None] | None,  # [B, V]; zeros/None = bonus
    u_final: torch.Tensor,  # [B] float64
) -> torch.Tensor:  # ids [B] int64
    from specsplit.kernels.reference import q_rows_tensor, random_finish_ref

    q = q_rows_tensor(draft_q_row, target_probs_row)
    if use_triton(target_probs_row.device):
        from specsplit.kernels.rejection_random import random_finish_triton

        return random_finish_triton(target_probs_row, q, u_final)
    return random_finish_ref(target_probs_row, q, u_final)


def store_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], written in place
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], written in place
    slot_mapping: torch.Tensor,  # [T] int64; slot = block * block_size + offset, < 0 = skip
    all_valid: bool = False,  # the caller knows no slot is < 0: the torch path skips masking
) -> None:
    from specsplit.kernels import kv_store

    if use_triton(k_cache.device):
        kv_store.store_kv_triton(key, value, k_cache, v_cache, slot_mapping)
    elif decode_ops.usable(key) and k_cache.dtype == torch.float32 and value.dtype == torch.float32:
        decode_ops.load().store_kv(key, value, k_cache, v_cache, slot_mapping)  # CPU fp32: one call
    elif all_valid:
        kv_store.store_kv_dense(key, value, k_cache, v_cache, slot_mapping)
    else:
        kv_store.store_kv_ref(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(
    q: torch.Tensor,  # [B, Q, Hq, D] queries of the new tokens (Q <= 8 or so)
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int
    context_lens: torch.Tensor,  # [B] int, cached tokens including the new ones
    q_lens: torch.Tensor,  # [B] int, valid new tokens per sequence
    scale: float | None = None,
) -> torch.Tensor:  # [B, Q, Hq, D]
    from specsplit.kernels import paged_attention as pa

    if use_triton(q.device):
        return pa.paged_attention_triton(
            q, k_cache, v_cache, block_tables, context_lens, q_lens, scale
        )
    return pa.paged_attention_ref(q, k_cache, v_cache, block_tables, context_lens, q_lens, scale)
