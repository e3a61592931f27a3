"""Logits -> the sampling distribution of one request (temperature, top-k, top-p, min-p).

The same transform is applied to the target's logits (giving p) and to the draft's (giving q), so
the rejection sampler reproduces exactly the distribution the target alone would sample from.

Semantics, row by row (one row = one position of one sequence):
  * temperature == 0: greedy; the row is the one-hot of argmax(logits) (first max index on ties,
    like torch.argmax). top-k / top-p are ignored.
  * otherwise: softmax(logits / T), then top-k (0 = off), then top-p on the renormalised top-k
    distribution, then min-p (0 = off), then renormalised. This is the order of transformers'
    TemperatureLogitsWarper -> TopKLogitsWarper -> TopPLogitsWarper -> MinPLogitsWarper.
  * top-k keeps every token whose scaled logit is >= the k-th largest (ties at the boundary are all
    kept, so the result does not depend on how a sort orders equal values).
  * top-p keeps the smallest prefix (in descending probability) whose mass reaches top_p, i.e.
    token i is kept when the mass strictly above it is < top_p; the argmax is always kept, and
    ties with the last kept value are kept too. top_p >= 1 switches it off.
  * min-p keeps every token whose probability is >= min_p times the largest one. The ratio of two
    probabilities does not change when a distribution is renormalised, and top-k / top-p always
    keep the largest, so this is the scaled-logit cut-off max + log(min_p) whatever was filtered
    before it (vLLM applies min-p before top-k / top-p; with top_p < 1 the two orders differ).
"""

from __future__ import annotations

from typing import Sequence

import torch

from specsplit.sampling.params import SamplingParams


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """[..., V] -> [...] int64: torch.argmax(logits, dim=-1), the greedy token of each row (the
    first index of the maximum on ties, a NaN counted as the maximum: both documented for argmax
    and for max's indices), computed as max(dim=-1).indices, which gives those ids about 3x
    faster on the CPU: SmolLM2's 49,152 logits, one thread, 65 -> 23 us a row, 323 -> 105 us for
    a 5-row verify (tests/unit/sampling/test_sampling_probs.py checks they agree)."""
    return logits.max(dim=-1).indices


def sampling_tensors(
    params: Sequence[SamplingParams],
    rows_per_seq: int | Sequence[int] = 1,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row (temperature [N] f32, top_k [N] i64, top_p [N] f32, min_p [N] f32) for logits_to_probs.

    rows_per_seq: how many logits rows each sequence owns, in order (the verifier scores k+1
    positions per sequence, the drafter one); an int applies to every sequence.
    """
    if isinstance(rows_per_seq, int):
        rows_per_seq = [rows_per_seq] * len(params)
    if len(rows_per_seq) != len(params):
        raise ValueError(f"rows_per_seq has {len(rows_per_seq)} entries for {len(params)} params")
    repeats = torch.tensor(list(rows_per_seq), dtype=torch.int64)
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32)
    top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
    min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32)
    return tuple(  # type: ignore[return-value]
        t.repeat_interleave(repeats).to(device) for t in (temperature, top_k, top_p, min_p)
    )


def logits_to_probs(
    logits: torch.Tensor,  # [N, V] any float dtype
    temperature: torch.Tensor,  # [N] float; 0 = greedy row
    top_k: torch.Tensor,  # [N] int; <= 0 = off
    top_p: torch.Tensor,  # [N] float in (0, 1]; >= 1 = off
    min_p: torch.Tensor | None = None,  # [N] float in [0, 1]; 0 = off (None: off everywhere)
) -> torch.Tensor:  # [N, V] float32, each row sums to 1
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}")
    n, vocab = logits.shape
    device = logits.device
    logits = logits.float()
    temperature = temperature.to(device=device, dtype=torch.float32).reshape(n)
    top_k = top_k.to(device=device, dtype=torch.int64).reshape(n)
    top_p = top_p.to(device=device, dtype=torch.float32).reshape(n)

    greedy = temperature == 0  # [N] bool
    safe_t = torch.where(greedy, torch.ones_like(temperature), temperature)
    scaled = logits / safe_t[:, None]  # [N, V]

    use_k = (top_k > 0) & (top_k < vocab) & ~greedy  # [N]
    use_p = (top_p < 1.0) & ~greedy  # [N]
    if bool((use_k | use_p).any()):
        scaled = _filter_top_k_top_p(scaled, top_k, top_p, use_k, use_p)
    if min_p is not None:
        min_p = min_p.to(device=device, dtype=torch.float32).reshape(n)
        use_min = (min_p > 0) & ~greedy  # [N]
        if bool(use_min.any()):
            floor = scaled.max(dim=-1, keepdim=True).values + torch.log(min_p.clamp(min=1e-30))[:, None]  # [N, 1]
            scaled = scaled.masked_fill(use_min[:, None] & (scaled < floor), float("-inf"))
    probs = torch.softmax(scaled, dim=-1)  # [N, V]

    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs)
        one_hot.scatter_(1, greedy_ids(logits)[:, None], 1.0)
        probs = torch.where(greedy[:, None], one_hot, probs)
    return probs


def _filter_top_k_top_p(
    scaled: torch.Tensor,  # [N, V] float32 logits / T
    top_k: torch.Tensor,  # [N] int64
    top_p: torch.Tensor,  # [N] float32
    use_k: torch.Tensor,  # [N] bool
    use_p: torch.Tensor,  # [N] bool
) -> torch.Tensor:  # [N, V] float32 with filtered entries at -inf
    """Mask tokens outside top-k / top-p. Cut-offs are logit values, so ties are all kept."""
    n, vocab = scaled.shape
    neg_inf = torch.tensor(float("-inf"), device=scaled.device)
    sorted_vals = scaled.sort(dim=-1, descending=True).values  # [N, V]

    # top-k: threshold at the k-th largest scaled logit.
    k_index = (top_k.clamp(1, vocab) - 1)[:, None]  # [N, 1]
    kth = sorted_vals.gather(1, k_index)  # [N, 1]
    kth = torch.where(use_k[:, None], kth, neg_inf)  # [N, 1]

    # top-p on the renormalised top-k distribution, in sorted order.
    sorted_masked = torch.where(sorted_vals >= kth, sorted_vals, neg_inf)  # [N, V]
    sorted_probs = torch.softmax(sorted_masked, dim=-1)  # [N, V] descending
    mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs  # [N, V] exclusive cumsum
    num_keep = (mass_above < top_p[:, None]).sum(dim=-1).clamp(min=1)  # [N]
    cutoff = sorted_vals.gather(1, (num_keep - 1)[:, None])  # [N, 1]
    cutoff = torch.where(use_p[:, None], cutoff, neg_inf)  # [N, 1]

    threshold = torch.maximum(kth, cutoff)  # [N, 1]
    return torch.where(scaled >= threshold, scaled, neg_inf)
