"""The emitted distribution equals the target's: chi-square and total variation over many samples.

Two set-ups, both vectorised over the sample dimension:
  * context-free: p and q fixed per position; the first emitted token must be ~ p_0, and the token
    at position j (when the step emits it) ~ p_j.
  * Markov: p(x | prev) and q(x | prev) tables over a small vocabulary, generation run over several
    speculative steps; the joint of the first two tokens must be the target chain's joint.
"""

import pytest
import torch
from scipy import stats

from specsplit.sampling import logits_to_probs
from specsplit.sampling.rejection import RejectionSampler
from specsplit.sampling.sample import integer_weights, sample_from_probs
from tests.helpers.rejection import sample_full

SAMPLER = RejectionSampler(backend="torch")
NUM_SAMPLES = 200_000


def _check(counts: torch.Tensor, expected_probs: torch.Tensor, tv_max: float) -> None:
    counts = counts.double()
    n = counts.sum()
    expected = expected_probs.double() / expected_probs.double().sum() * n
    # tokens the target gives no mass must never appear
    assert counts[expected == 0].sum() == 0, "emitted a token with zero target probability"
    keep = expected > 0
    counts, expected = counts[keep], expected[keep]
    big = expected >= 5  # pool sparse cells so the chi-square approximation holds
    f_obs = torch.cat([counts[big], counts[~big].sum().reshape(1)])
    f_exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    if f_exp[-1] == 0:
        f_obs, f_exp = f_obs[:-1], f_exp[:-1]
    pvalue = stats.chisquare(f_obs.numpy(), f_exp.numpy()).pvalue
    tv = 0.5 * (counts / n - expected / n).abs().sum().item()
    assert pvalue > 1e-3, f"chi-square p-value {pvalue:.2e}"
    assert tv < tv_max, f"total variation {tv:.4f}"


def _tables(shape, vocab, gen, temperature=1.0, top_k=0, top_p=1.0):
    logits = torch.randn(*shape, vocab, generator=gen) * 1.5
    flat = logits.reshape(-1, vocab)
    n = flat.shape[0]
    probs = logits_to_probs(
        flat, torch.full((n,), temperature), torch.full((n,), top_k), torch.full((n,), top_p)
    )
    return probs.reshape(*shape, vocab)


def _sample_rows(table, rows, gen):
    """sample_from_probs(table[rows], u) with the integer CDF of each table row computed once.

    table [R, V] float32, rows [N] int64 -> ids [N] int64; a test below checks the equivalence.
    """
    u = torch.rand(rows.shape[0], dtype=torch.float64, generator=gen)  # [N]
    cdf = integer_weights(table).cumsum(-1)[rows]  # [N, V] int64
    total = cdf[:, -1]
    threshold = torch.minimum(torch.floor(u * total.double()).to(torch.int64), total - 1)
    return (cdf <= threshold[:, None]).sum(-1)


def test_fast_row_sampler_matches_sample_from_probs():
    gen = torch.Generator().manual_seed(0)
    table = _tables((3,), 17, gen)
    rows = torch.randint(0, 3, (1000,), generator=gen)
    state = gen.get_state()
    fast = _sample_rows(table, rows, gen)
    gen.set_state(state)
    u = torch.rand(1000, dtype=torch.float64, generator=gen)
    assert torch.equal(fast, sample_from_probs(table[rows], u))


def _draft_context_free(q_pos, n, gen):  # q_pos [K, V] -> ids [n, K]
    k = q_pos.shape[0]
    return torch.stack([_sample_rows(q_pos, torch.full((n,), j), gen) for j in range(k)], 1)


@pytest.mark.parametrize(
    "vocab,k,q_filter",
    [(10, 1, {}), (20, 3, {"top_k": 8, "top_p": 0.9}), (50, 5, {"temperature": 2.0})],
)
def test_context_free_positions_follow_p(vocab, k, q_filter):
    gen = torch.Generator().manual_seed(vocab * 10 + k)
    p_pos = _tables((k + 1,), vocab, gen, top_k=vocab // 2)  # [K+1, V] target per position
    q_pos = _tables((k,), vocab, gen, **q_filter)  # [K, V] a different draft per position
    n = NUM_SAMPLES
    q_full = q_pos[None].expand(n, k, vocab)
    p_full = p_pos[None].expand(n, k + 1, vocab)
    draft = _draft_context_free(q_pos, n, gen)
    num_draft = torch.full((n,), k)
    u_a = torch.rand(n, k, dtype=torch.float64, generator=gen)
    u_f = torch.rand(n, dtype=torch.float64, generator=gen)
    num_accepted, out = sample_full(SAMPLER, draft, q_full, num_draft, p_full, u_a, u_f)

    _check(torch.bincount(out[:, 0], minlength=vocab), p_pos[0], tv_max=0.01)
    for j in range(1, k + 1):
        emitted = out[:, j][out[:, j] >= 0]
        if emitted.numel() < 20_000:
            break
        tv_max = 0.01 if emitted.numel() >= NUM_SAMPLES // 2 else 0.02
        _check(torch.bincount(emitted, minlength=vocab), p_pos[j], tv_max=tv_max)
    assert 0 < num_accepted.double().mean() < k


def _generate_markov(p_table, q_table, k, length, n, gen, mixed_num_draft):
    """Run speculative steps until every sample has `length` tokens; return them [n, length]."""
    start_token = 0
    tokens = torch.full((n, length + k + 1), -1, dtype=torch.long)
    count = torch.zeros(n, dtype=torch.long)
    rows = torch.arange(n)
    while (count < length).any():
        active = rows[count < length]
        m = active.numel()
        last = torch.where(
            count[active] > 0, tokens[active, (count[active] - 1).clamp(min=0)], start_token
        )
        # draft k tokens autoregressively from q
        prev = last
        drafts, q_rows = [], []
        for _ in range(k):
            x = _sample_rows(q_table, prev, gen)  # [m] drafted from q(. | prev)
            drafts.append(x)
            q_rows.append(q_table[prev])  # [m, V]
            prev = x
        draft = torch.stack(drafts, 1)  # [m, K]
        q_full = torch.stack(q_rows, 1)  # [m, K, V]
        contexts = torch.cat([last[:, None], draft], 1)  # [m, K+1]: the token before each position
        p_full = p_table[contexts]  # [m, K+1, V]
        if mixed_num_draft:
            num_draft = torch.randint(0, k + 1, (m,), generator=gen)
        else:
            num_draft = torch.full((m,), k)
        u_a = torch.rand(m, k, dtype=torch.float64, generator=gen)
        u_f = torch.rand(m, dtype=torch.float64, generator=gen)
        num_accepted, out = sample_full(SAMPLER, draft, q_full, num_draft, p_full, u_a, u_f)
        emitted = num_accepted + 1
        cols = count[active, None] + torch.arange(k + 1)[None]  # [m, K+1]
        valid = torch.arange(k + 1)[None] < emitted[:, None]
        tokens[active[:, None].expand(m, k + 1)[valid], cols[valid]] = out[valid]
        count[active] += emitted
    return tokens[:, :length]


@pytest.mark.parametrize("vocab,k,mixed", [(10, 3, True), (10, 5, False)])
def test_markov_joint_of_two_tokens_matches_target(vocab, k, mixed):
    gen = torch.Generator().manual_seed(1000 + vocab + k)
    p_table = _tables((vocab,), vocab, gen, temperature=0.8, top_p=0.9)  # [prev, V]
    q_table = _tables((vocab,), vocab, gen, top_k=5)  # [prev, V]
    tokens = _generate_markov(
        p_table, q_table, k, length=2, n=NUM_SAMPLES, gen=gen, mixed_num_draft=mixed
    )
    joint = p_table[0][:, None] * p_table  # [V, V]: p(x0 | start) * p(x1 | x0)
    counts = torch.bincount(tokens[:, 0] * vocab + tokens[:, 1], minlength=vocab * vocab)
    # 100 cells at 200k samples: sampling noise alone gives a TV around 0.01, so bound it at 0.02
    _check(counts, joint.reshape(-1), tv_max=0.02)
    _check(torch.bincount(tokens[:, 0], minlength=vocab), p_table[0], tv_max=0.01)


def test_detects_a_wrong_sampler():
    """Sanity check of the test itself: emitting the draft token unconditionally must fail."""
    gen = torch.Generator().manual_seed(7)
    vocab = 10
    p = _tables((1,), vocab, gen)[0]
    q = _tables((1,), vocab, gen)[0]
    draft = _sample_rows(q[None], torch.zeros(NUM_SAMPLES, dtype=torch.long), gen)
    with pytest.raises(AssertionError):
        _check(torch.bincount(draft, minlength=vocab), p, tv_max=0.01)
