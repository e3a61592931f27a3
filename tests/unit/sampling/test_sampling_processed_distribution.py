"""Sampling with penalties, logit_bias, min_tokens, top-p / min-p and a grammar stays exact under speculation: the emitted
distribution is the constrained, penalized target's (chi-square and total variation).

The verifier (specsplit.engine.TargetEngine, the real one: penalties, grammar cuts and masks,
rejection sampler, resolve with the drafter's q rows) runs over a table model: the target's logits
at a position depend only on the token before it (a Markov chain over 8 words of the tiny
tokenizer), the draft is a fixed distribution q. Thousands of sequences step once or twice, and the
joint of their first two emitted tokens is compared with the target chain's, computed exactly with
the same penalties (which depend on the first token) and the grammar (which alternates two word
sets, so the drafts often leave it: cut, and rejected from the residual)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from specsplit.engine import TargetEngine
from specsplit.protocols import QRow, SeqAdd, VerifyRequest
from specsplit.sampling.grammar import GrammarCompiler, apply_masks
from specsplit.sampling.params import Grammar, SamplingParams
from specsplit.sampling.penalties import penalize
from specsplit.sampling.probs import logits_to_probs, sampling_tensors
from specsplit.sampling.rejection import RejectionSampler
from tests.helpers.chisquare import joint_fit
from tests.helpers.tiny_models import VOCAB_WORDS, write_tokenizer

V = len(VOCAB_WORDS)  # 256
WORDS = list(range(3, 11))  # w0 .. w7
PROMPT = (5, 9, 5)  # w2 w6 w2
N = 4000
K = 3


class _Blocks:
    """The block manager's surface an engine calls; a table runner has no KV and caches nothing."""

    def allocate(self, seq_id, n, token_ids=None) -> int:
        return 0  # tokens of a cached prefix: none

    def cache_prefix(self, seq_id, token_ids, num_tokens):
        pass

    def has(self, seq_id) -> bool:
        return False

    def grow_to(self, seq_id, num_tokens):
        pass


class _TableRunner:
    """logits of the position after token t = table[t] (-inf outside WORDS)."""

    def __init__(self, table: torch.Tensor):
        self.table = table
        self.vocab_size = V
        self.max_model_len = 64
        self.block_manager = _Blocks()

    def forward(self, items, features=(), out=None):
        return [self.table[torch.tensor(it.token_ids[len(it.token_ids) - it.num_logits:])] for it in items]

    def truncate(self, seq_id, n):
        pass

    def free(self, seq_id):
        pass


@pytest.fixture(scope="module")
def compiler(tmp_path_factory):
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("tok")
    write_tokenizer(d)
    return GrammarCompiler(AutoTokenizer.from_pretrained(d), V, (2,))


def _exact_joint(table, params, compiler) -> dict:
    """P(t0, t1) of the target alone: each row penalized from the tokens before it, then masked."""

    def dist(context_last, generated):
        row = penalize(table[context_last][None], params, PROMPT, generated)
        if params.grammar is not None:
            st = compiler.state(params.grammar)
            st.sync(generated)
            apply_masks(row, st.masks(())[1])
        return logits_to_probs(row, *sampling_tensors([params]))[0].double()  # temperature, top-k/p, min-p

    joint = {}
    p0 = dist(PROMPT[-1], [])
    for a in WORDS:
        if p0[a] == 0:
            continue
        p1 = dist(a, [a])
        for b in WORDS:
            if p1[b] > 0:
                joint[(a, b)] = float(p0[a] * p1[b])
    return joint


CASES = {
    "penalties": dict(presence_penalty=0.8, frequency_penalty=1.1, repetition_penalty=1.6, logit_bias=((4, 1.5), (7, -2.0))),
    "grammar": dict(grammar=Grammar("regex", "((w0|w1|w2|w3)(w4|w5|w6|w7))+")),
    "both": dict(presence_penalty=-0.5, frequency_penalty=0.9, repetition_penalty=0.7, logit_bias=((10, 2.0),),
                 grammar=Grammar("regex", "((w0|w1|w2|w3)(w4|w5|w6|w7))+")),
    # the first token is never w0 or w3 (the stop ids min_tokens holds back); the second may be
    "min_tokens": dict(min_tokens=1, min_tokens_stop_ids=(3, 6), presence_penalty=0.5),
    # top-p, then min-p: tokens below 0.25 x the largest probability are never emitted
    "min_p": dict(min_p=0.25, top_p=0.97, frequency_penalty=0.6),
}


@pytest.mark.parametrize("case", list(CASES))
def test_emitted_joint_is_the_processed_targets(compiler, case):
    gen = torch.Generator().manual_seed(11)
    table = torch.full((V, V), float("-inf"))
    table[:, WORDS] = torch.randn(V, len(WORDS), generator=gen) * 1.2
    q = torch.zeros(V)
    q[WORDS] = torch.softmax(torch.randn(len(WORDS), generator=gen), -1)  # the draft: context-free
    params = SamplingParams(temperature=1.0, **CASES[case])
    eng = TargetEngine(_TableRunner(table), sampler=RejectionSampler(backend="torch"), grammars=compiler)
    ids = [f"s{i}" for i in range(N)]
    # Seeded rejection sampling (coupling off), one seed per sequence: independent and reproducible.
    eng.add([SeqAdd(s, PROMPT, replace(params, seed=i, coupling=False)) for i, s in enumerate(ids)])
    out = {s: [] for s in ids}
    for _ in range(3):  # steps until every sequence has two tokens (each step emits at least one)
        live = [s for s in ids if len(out[s]) < 2]
        if not live:
            break
        drafts = torch.multinomial(q, len(live) * K, replacement=True, generator=gen).reshape(len(live), K)
        reqs = [VerifyRequest(s, tuple(d), tuple(float(q[x]) for x in d)) for s, d in zip(live, drafts.tolist())]
        results = eng.verify(reqs)
        pending = [r for r in results if r.pending_position is not None]
        resolved = {r.seq_id: r for r in eng.resolve([QRow(r.seq_id, q.clone()) for r in pending])}
        for r in results:
            out[r.seq_id] += resolved.get(r.seq_id, r).token_ids
    assert all(len(o) >= 2 for o in out.values())
    if params.min_tokens:  # the case tests something: the held-back ids are likely without it
        unheld = torch.softmax(table[PROMPT[-1]].double(), -1)
        assert float(unheld[list(params.min_tokens_stop_ids)].sum()) > 0.05
        assert not any(o[0] in params.min_tokens_stop_ids for o in out.values())
        assert any(o[1] in params.min_tokens_stop_ids for o in out.values())
    exact = _exact_joint(table, params, compiler)
    if params.min_p:  # the case tests something: every word may come first without it, not with it
        assert len({a for a, _ in exact}) < len(WORDS)
        assert {o[0] for o in out.values()} == {a for a, _ in exact}
    pvalue, tv = joint_fit([tuple(o[:2]) for o in out.values()], exact)
    assert pvalue > 1e-3, f"chi-square p-value {pvalue:.2e} (total variation {tv:.4f})"
    assert tv < 0.05, f"total variation {tv:.4f}"
