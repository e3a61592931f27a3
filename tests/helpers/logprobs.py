"""The reference for GenerateRequest.logprobs: log_softmax of the target's fp32 logits from a
target-only transformers forward of prompt + output, and a check of streamed GenerateResponses
against it."""
from __future__ import annotations

import torch

TOL = 1e-4


def reference_logprobs(model, prompt, output) -> torch.Tensor:
    """[len(output), V]: log_softmax of the target's logits at each output position."""
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt) + list(output)])).logits[0].float()  # [L, V]
    return torch.log_softmax(logits[len(prompt) - 1: len(prompt) + len(output) - 1], dim=-1)


def check_streamed_logprobs(model, prompt, msgs, n: int) -> list[int]:
    """GenerateResponses of one stream: one TokenLogprob per token, each equal to the reference
    (TOL), with the n most likely alternatives, most likely first. Returns the streamed ids."""
    ids = [t for m in msgs for t in m.token_ids]
    lps = [lp for m in msgs for lp in m.logprobs]
    assert all(len(m.logprobs) == len(m.token_ids) for m in msgs)
    assert [lp.token_id for lp in lps] == ids
    ref = reference_logprobs(model, prompt, ids)
    for j, lp in enumerate(lps):
        assert abs(lp.logprob - float(ref[j, lp.token_id])) < TOL, j
        assert len(lp.top) == n
        best = ref[j].topk(n).values.tolist()
        for alt, b in zip(lp.top, best):
            assert abs(alt.logprob - float(ref[j, alt.token_id])) < TOL and abs(alt.logprob - b) < TOL
    return ids
