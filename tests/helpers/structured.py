"""The reference's next-token logits as the verifier scores them for a request with penalties,
logit_bias and a grammar: what certifies a greedy near-tie of the *constrained* target
(tests/helpers/greedy.py)."""
from __future__ import annotations

from typing import Sequence

from specsplit.sampling.grammar import GrammarCompiler, apply_masks
from specsplit.sampling.params import SamplingParams
from specsplit.sampling.penalties import penalize
from tests.helpers.greedy import NextLogits


def constrained_next_logits(next_logits: NextLogits, params: SamplingParams, prompt_len: int,
                            compiler: GrammarCompiler | None) -> NextLogits:
    """next_logits with the request's penalties (the context past prompt_len is generated), then its
    grammar's mask after those generated tokens (a fresh matcher), applied."""

    def f(context: Sequence[int]):
        context = list(context)
        rows = penalize(next_logits(context)[None], params, context[:prompt_len], context[prompt_len:])
        if params.grammar is not None:
            st = compiler.state(params.grammar)
            st.sync(context[prompt_len:])
            apply_masks(rows, st.masks(())[1])
        return rows[0]

    return f
