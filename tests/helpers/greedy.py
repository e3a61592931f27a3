"""Greedy equality that cannot flake: exact, except at a certified near-tie of the reference.

Two fp32 runs of the same model that reduce in a different order (another batch size, K, a tensor-
parallel split, transformers vs the native forward) give logits that differ by rounding. Greedy
decoding then agrees token for token unless, at some position, the reference's two best tokens are
closer than that rounding; there the two runs may legitimately pick different tokens, and every
token after that depends on the pick, so nothing later can be compared.

`assert_greedy_equal_or_tie` compares an output with its reference token by token. At the first
position where they differ it asks the reference model for its logits there (the context is the
prompt plus the common prefix, so both runs saw the same tokens) and accepts the difference only
when both tokens are within `bound` of the row's maximum (so their gap is below it too): a
certified tie. Then it stops comparing that sequence. Any other difference fails, with the gap in
the message. No retries, no 'most prompts match'.

The bound. fp32 has a unit roundoff of 2^-24 ~ 6e-8; a logit of SmolLM2-135M is a dot product of
576 terms at the end of 30 layers of reductions with thousands of terms, whose order changes with
the number of rows in a call, the kernel's blocking and the tensor-parallel split. Measured here
(fp32, 4 held-out ShareGPT prompts + 32 greedy tokens, teacher-forced): max |native - transformers|
8e-5, max |TP=2 - transformers| 1.0e-4, max |TP=2 - TP=1| 1.0e-4 over all 49,152 logits of every
position, logits up to ~36 in magnitude (a relative error of ~3e-6); the tiny test models stay
below 1e-5, and tests/unit/models/test_native_vs_hf.py holds the native forward within 1e-4 of
transformers. Two runs can pick different tokens only where the reference's top-2 gap is below
the sum of their errors (~2e-4), so TIE_BOUND = 1e-3 certifies every flip rounding can cause with a
5x margin. A real bug (a wrong token, position or stale KV entry) moves logits by far more, and
gaps that small are rare (the smallest top-2 gap on those 128 generated positions was 0.067), so a
broken model cannot hide behind ties.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

TIE_BOUND = 1e-3

# context token ids (prompt + generated prefix) -> the reference model's next-token logits [V]
NextLogits = Callable[[Sequence[int]], torch.Tensor]


@dataclass(frozen=True)
class Comparison:
    equal: bool  # identical token for token
    tie_at: int | None = None  # index in the output of the first (certified) tied difference
    gap: float = 0.0  # the reference's logit gap between the two tokens there


def compare_greedy(ref_tokens: Sequence[int], out_tokens: Sequence[int], prompt: Sequence[int],
                   next_logits: NextLogits, bound: float = TIE_BOUND) -> Comparison:
    """Exact, or the first difference is a certified tie of the reference (else AssertionError)."""
    ref, out = list(ref_tokens), list(out_tokens)
    if ref == out:
        return Comparison(True)
    i = next((j for j, (a, b) in enumerate(zip(ref, out)) if a != b), None)
    if i is None:  # one is a prefix of the other: a length difference is never a tie
        raise AssertionError(f"output has {len(out)} tokens, the reference {len(ref)}, equal up to the shorter:\n"
                             f"  reference {ref}\n  output    {out}")
    logits = next_logits(list(prompt) + ref[:i]).float().reshape(-1)
    a, b = ref[i], out[i]
    top = float(logits.max())
    gap = abs(float(logits[a]) - float(logits[b]))
    from_top = top - min(float(logits[a]), float(logits[b]))
    if from_top > bound:
        raise AssertionError(
            f"greedy differs at token {i}: reference {a} (logit {float(logits[a]):.6f}), output {b} "
            f"(logit {float(logits[b]):.6f}), best logit {top:.6f}: {from_top:.3g} from the top is not a tie "
            f"(bound {bound:g})\n  prompt    {list(prompt)}\n  reference {ref}\n  output    {out}")
    return Comparison(False, i, gap)


def assert_greedy_equal_or_tie(ref_tokens: Sequence[int], next_logits: NextLogits, out_tokens: Sequence[int],
                               prompt: Sequence[int] = (), bound: float = TIE_BOUND) -> Comparison:
    """Assert out_tokens == ref_tokens, except from a certified near-tie of the reference on."""
    return compare_greedy(ref_tokens, out_tokens, prompt, next_logits, bound)


def assert_outputs_equal_or_tie(ref_outputs: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]],
                                prompts: Sequence[Sequence[int]], next_logits: NextLogits,
                                bound: float = TIE_BOUND) -> list[Comparison]:
    """assert_greedy_equal_or_tie for each (reference, output, prompt) of a batch."""
    assert len(outputs) == len(ref_outputs) == len(prompts), (len(outputs), len(ref_outputs), len(prompts))
    return [compare_greedy(r, o, p, next_logits, bound) for r, o, p in zip(ref_outputs, outputs, prompts)]


def hf_next_logits(hf_model) -> NextLogits:
    """A transformers model (fp32, eval) as a reference: logits after the whole context."""

    def fn(context: Sequence[int]) -> torch.Tensor:
        with torch.no_grad():
            return hf_model(torch.tensor([list(context)])).logits[0, -1].float()

    return fn


def native_next_logits(model, block_size: int = 16) -> NextLogits:
    """A native LlamaForCausalLM as a reference: one prefill of the context in a fresh paged cache."""
    from specsplit.models.runner import ForwardItem, ModelRunner

    def fn(context: Sequence[int]) -> torch.Tensor:
        n = len(context)
        blocks = (n + block_size - 1) // block_size + 1
        runner = ModelRunner(model, num_blocks=blocks, block_size=block_size, max_model_len=n)
        return runner.forward([ForwardItem("tie-check", 0, list(context))])[0][-1]

    return fn
