"""kernels/decode_ops: the C++ RMSNorm, rope and paged attention equal the torch path they replace
(within fp32 summation order) on mixed batches (decode, verify and prefill rows; blocks scattered
through the cache; GQA), a verify row equals the decode row at its position bit for bit, and the
whole model with the ops gives the torch ops' logits."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specsplit.draft_tree import DraftTree, ancestor_bits, ancestor_mask
from specsplit.kernels import decode_ops, quant_linear
from specsplit.models.attention import BatchMetadata
from specsplit.models.llama import RMSNorm, RotaryEmbedding

pytestmark = pytest.mark.skipif(decode_ops.load() is None, reason="no AVX2/FMA CPU or no C++ compiler: decode ops off")
# the attention's loops: the 8-lane one everywhere, the 16-lane one where the CPU has AVX-512
# (the same CPU test that quant_linear's AVX-512 loop makes)
ISAS = [False, True] if quant_linear.uses_avx512() else [False]


def torch_attention(query, k_cache, v_cache, meta: BatchMetadata, scale: float) -> torch.Tensor:
    """The rule written plainly, in float64: token i of sequence b attends to positions <= its own."""
    out, t = [], 0
    bs = k_cache.shape[1]
    for b, (q, kv) in enumerate(zip(meta.q_lens, meta.kv_lens)):
        table = meta.block_tables[b]
        slots = torch.stack([table[j // bs] * bs + j % bs for j in range(kv)])  # [kv]
        keys = k_cache.reshape(-1, *k_cache.shape[2:])[slots].double()  # [kv, Hkv, D]
        values = v_cache.reshape(-1, *v_cache.shape[2:])[slots].double()
        rep = query.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1)  # [kv, H, D]
        for i in range(q):
            pos = kv - q + i
            s = torch.einsum("hd,khd->hk", query[t].double(), keys[: pos + 1]) * scale  # [H, pos+1]
            out.append(torch.einsum("hk,khd->hd", torch.softmax(s, -1), values[: pos + 1]))
            t += 1
    return torch.stack(out).float()


@pytest.mark.parametrize("avx512", ISAS)
def test_paged_attention_mixed_batch_matches_reference(avx512):
    g = torch.Generator().manual_seed(0)
    nb, bs, hkv, d, h = 40, 16, 3, 64, 9
    k_cache, v_cache = torch.randn(nb, bs, hkv, d, generator=g), torch.randn(nb, bs, hkv, d, generator=g)
    perm = torch.randperm(nb, generator=g).tolist()
    q_lens, kv_lens = [1, 4, 37, 1], [300, 5, 37, 17]  # decode, verify, prefill, decode
    tables, used = [], 0
    for kv in kv_lens:
        n = -(-kv // bs)
        tables.append(perm[used:used + n])
        used += n
    meta = BatchMetadata.build(q_lens, kv_lens, tables, [0] * sum(q_lens), [1] * len(q_lens), bs, torch.device("cpu"))
    query = torch.randn(sum(q_lens), h, d, generator=g)
    got = decode_ops.load().paged_attention(query, k_cache, v_cache, meta.block_tables, meta.q_lens_t, meta.kv_lens_t, d**-0.5,
                                            avx512)
    torch.testing.assert_close(got, torch_attention(query, k_cache, v_cache, meta, d**-0.5), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("avx512", ISAS)
def test_verify_rows_equal_decode_rows_bit_for_bit(avx512):
    g = torch.Generator().manual_seed(1)
    k_cache, v_cache = torch.randn(8, 16, 3, 64, generator=g), torch.randn(8, 16, 3, 64, generator=g)
    query = torch.randn(4, 9, 64, generator=g)
    op = decode_ops.load().paged_attention
    t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    table = t([[5, 2, 7]])
    verify = op(query, k_cache, v_cache, table, t([4]), t([40]), 0.125, avx512)  # positions 36..39
    for i in range(4):
        decode = op(query[i:i + 1].contiguous(), k_cache, v_cache, table, t([1]), t([37 + i]), 0.125, avx512)
        assert torch.equal(verify[i:i + 1], decode)


@pytest.mark.parametrize("avx512", ISAS)
@pytest.mark.parametrize("d, hkv, h", [(64, 3, 9), (32, 2, 2), (24, 1, 4)])  # 24: the 8-lane path on every CPU
def test_runs_of_verify_rows_equal_decode_rows_and_the_reference(d, hkv, h, avx512):
    """A batch of sequences with 1 to 13 new rows each (runs of up to 8 rows share their passes
    over the cache where AVX-512 runs; output rows in blocks of 4) at contexts that end inside a
    block of 8 keys and at its edge: every row equals that row decoded alone, bit for bit, and the
    float64 rule within fp32 summation order."""
    g = torch.Generator().manual_seed(2)
    bs, nb = 16, 48
    k_cache, v_cache = torch.randn(nb, bs, hkv, d, generator=g), torch.randn(nb, bs, hkv, d, generator=g)
    q_lens, kv_lens = [1, 5, 13, 8, 9, 3], [7, 40, 61, 8, 100, 17]
    perm, tables, used = torch.randperm(nb, generator=g).tolist(), [], 0
    for kv in kv_lens:
        tables.append(perm[used:used + -(-kv // bs)])
        used += -(-kv // bs)
    meta = BatchMetadata.build(q_lens, kv_lens, tables, [0] * sum(q_lens), [1] * len(q_lens), bs, torch.device("cpu"))
    query = torch.randn(sum(q_lens), h, d, generator=g)
    op = decode_ops.load().paged_attention
    got = op(query, k_cache, v_cache, meta.block_tables, meta.q_lens_t, meta.kv_lens_t, d**-0.5, avx512)
    torch.testing.assert_close(got, torch_attention(query, k_cache, v_cache, meta, d**-0.5), rtol=1e-5, atol=1e-6)
    t, row = (lambda xs: torch.tensor(xs, dtype=torch.int64)), 0  # noqa: E731
    for b, (q, kv) in enumerate(zip(q_lens, kv_lens)):
        for i in range(q):
            alone = op(query[row:row + 1].contiguous(), k_cache, v_cache, t([tables[b]]), t([1]), t([kv - q + i + 1]), d**-0.5,
                       avx512)
            assert torch.equal(got[row:row + 1], alone), (b, i)
            row += 1


@pytest.mark.parametrize("avx512", ISAS)
def test_threads_split_the_heads_without_changing_the_bits(avx512):
    """One thread takes all KV heads of a run in one pass over the keys; more threads share the
    heads out. The sums are the same either way: the same output bits."""
    g = torch.Generator().manual_seed(3)
    k_cache, v_cache = torch.randn(24, 16, 3, 64, generator=g), torch.randn(24, 16, 3, 64, generator=g)
    t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    tables, q_lens, kv_lens = t([list(range(0, 12)), list(range(12, 24))]), t([1, 5]), t([181, 97])
    query = torch.randn(6, 9, 64, generator=g)
    op = decode_ops.load().paged_attention
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = op(query, k_cache, v_cache, tables, q_lens, kv_lens, 0.125, avx512)
        torch.set_num_threads(2)
        two = op(query, k_cache, v_cache, tables, q_lens, kv_lens, 0.125, avx512)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def _tree_reference(query, k_cache, v_cache, table, kv, parents, scale):
    """Float64: tree node i (of n, in the last n slots) over the slots before the tree and its
    ancestors' slots (draft_tree.ancestor_mask), [n, H, D]."""
    bs, n = k_cache.shape[1], len(parents)
    slots = torch.tensor([table[j // bs] * bs + j % bs for j in range(kv)])  # [kv]
    keys = k_cache.reshape(-1, *k_cache.shape[2:])[slots].double()  # [kv, Hkv, D]
    values = v_cache.reshape(-1, *v_cache.shape[2:])[slots].double()
    rep = query.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1)  # [kv, H, D]
    seen = torch.cat([torch.ones(n, kv - n, dtype=torch.bool), ancestor_mask(parents)], dim=1)  # [n, kv]
    out = []
    for i in range(n):
        s = torch.einsum("hd,khd->hk", query[i].double(), keys[seen[i]]) * scale  # [H, keys seen]
        out.append(torch.einsum("hk,khd->hd", torch.softmax(s, -1), values[seen[i]]))
    return torch.stack(out).float()


@pytest.mark.parametrize("avx512", ISAS)
@pytest.mark.parametrize("context", [5, 37, 300])  # the slots before the tree: within, at the edge of, past blocks of 8
def test_tree_rows_see_their_ancestors_and_equal_their_paths_as_chains(avx512, context):
    """A batch of a decode row, a sequence whose last 7 rows are a draft tree (after 2 causal rows)
    and a 3-row verify: every tree node equals the float64 rule with the ancestor mask, and, bit for
    bit, the last row of its path verified as a chain (the path's K/V moved to the slots a chain
    uses, as ModelRunner.move_kv does); the other rows equal the same batch without the tree."""
    g = torch.Generator().manual_seed(4)
    bs, nb, hkv, d, h = 16, 64, 3, 64, 9
    k_cache, v_cache = torch.randn(nb, bs, hkv, d, generator=g), torch.randn(nb, bs, hkv, d, generator=g)
    parents = (-1, 0, 0, 1, 3, -1, 5)
    n = len(parents)
    q_lens, kv_lens = [1, 2 + n, 3], [29, context + 2 + n, 50]
    perm, tables, used = torch.randperm(nb, generator=g).tolist(), [], 0
    for kv in kv_lens:
        tables.append(perm[used:used + -(-kv // bs)])
        used += -(-kv // bs)
    trees = [None, parents, None]
    meta = BatchMetadata.build(q_lens, kv_lens, tables, [0] * sum(q_lens), [1] * 3, bs, torch.device("cpu"), trees=trees)
    assert meta.tree_mask.tolist() == [0, 0, 0, *ancestor_bits(parents), 0, 0, 0]
    query = torch.randn(sum(q_lens), h, d, generator=g)
    op = decode_ops.load().paged_attention
    got = op(query, k_cache, v_cache, meta.block_tables, meta.q_lens_t, meta.kv_lens_t, d**-0.5, avx512, meta.tree_mask)
    causal = op(query, k_cache, v_cache, meta.block_tables, meta.q_lens_t, meta.kv_lens_t, d**-0.5, avx512)
    nodes = slice(3, 3 + n)  # the tree's rows: after a's row and b's two causal rows
    keep = [r for r in range(sum(q_lens)) if not nodes.start <= r < nodes.stop]
    assert torch.equal(got[keep], causal[keep])
    kv = kv_lens[1]
    torch.testing.assert_close(got[nodes], _tree_reference(query[nodes], k_cache, v_cache, tables[1], kv, parents, d**-0.5),
                               rtol=1e-5, atol=1e-6)
    t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    slot = lambda j: tables[1][j // bs] * bs + j % bs  # noqa: E731
    for i in range(n):
        path = DraftTree(tuple(range(n)), parents).path(i)  # node ids from the root's child to i
        kc, vc = k_cache.clone().view(-1, hkv, d), v_cache.clone().view(-1, hkv, d)
        for depth, node in enumerate(path):  # the chain's slot of depth `depth`: kv - n + depth
            kc[slot(kv - n + depth)], vc[slot(kv - n + depth)] = k_cache.view(-1, hkv, d)[slot(kv - n + node)], \
                v_cache.view(-1, hkv, d)[slot(kv - n + node)]
        row = query[nodes.start + i:nodes.start + i + 1].contiguous()
        chain = op(row, kc.view_as(k_cache), vc.view_as(v_cache), t([tables[1]]), t([1]), t([kv - n + len(path)]),
                   d**-0.5, avx512)
        assert torch.equal(got[nodes.start + i:nodes.start + i + 1], chain), i


def test_paged_attention_refuses_a_bad_tree_mask_with_a_message():
    op = decode_ops.load().paged_attention
    k = torch.zeros(4, 16, 3, 64)
    t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    args = (torch.zeros(3, 9, 64), k, k, t([[0, 1]]), t([3]), t([20]), 0.125, True)
    op(*args, t([0, 1, 3]))  # the root, then a node and its child
    with pytest.raises(RuntimeError, match="last rows"):
        op(*args, t([1, 0, 0]))
    with pytest.raises(RuntimeError, match="must have bit 1 set and none above"):
        op(*args, t([0, 1, 1]))  # node 1 does not see itself
    with pytest.raises(RuntimeError, match="must have bit 0 set and none above"):
        op(*args, t([0, 3, 3]))  # node 0 sees a later node
    with pytest.raises(RuntimeError, match="int64 \\[T\\]"):
        op(*args, t([0, 1]))


def test_paged_attention_refuses_bad_shapes_with_a_message():
    op = decode_ops.load().paged_attention
    k = torch.zeros(2, 16, 3, 64)
    t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    with pytest.raises(RuntimeError, match="q_lens add up"):
        op(torch.zeros(3, 9, 64), k, k, t([[0, 1]]), t([2]), t([20]), 0.125, True)
    with pytest.raises(RuntimeError, match="kv_len"):
        op(torch.zeros(1, 9, 64), k, k, t([[0, 1]]), t([1]), t([40]), 0.125, True)
    with pytest.raises(RuntimeError, match="outside the cache"):
        op(torch.zeros(1, 9, 64), k, k, t([[0, 5]]), t([1]), t([20]), 0.125, True)


def test_rms_norm_and_rope_match_torch():
    g = torch.Generator().manual_seed(2)
    norm = RMSNorm(576, 1e-5, torch.float32, "cpu")
    norm.weight.data = torch.randn(576, generator=g)
    x = torch.randn(7, 576, generator=g)
    ref = norm.weight * F.rms_norm(x, (576,), eps=1e-5)
    torch.testing.assert_close(norm(x), ref, rtol=1e-5, atol=1e-5)
    qkv = torch.randn(5, 960, generator=g)  # strided rows, as the layer's q|k view of its qkv output
    x = qkv[:, :768].view(5, 12, 64)
    cos, sin = torch.randn(5, 1, 64, generator=g), torch.randn(5, 1, 64, generator=g)
    x1, x2 = x.chunk(2, dim=-1)
    ref = x * cos + torch.cat((x2, x1), dim=-1) * sin
    torch.testing.assert_close(RotaryEmbedding.apply(x, cos, sin), ref, rtol=0, atol=1e-6)


def test_model_logits_match_the_torch_ops(monkeypatch, tiny_llama):
    """The whole forward (decode and a verify-sized step over a cached prefix) with the ops and
    without them: the same logits within fp32 rounding."""
    from specsplit.models.loader import load_model
    from specsplit.models.runner import ForwardItem, ModelRunner

    model = load_model(str(tiny_llama), show_progress=False).model
    prompt = [(7 * j + 3) % model.cfg.vocab_size for j in range(45)]

    def run() -> torch.Tensor:
        runner = ModelRunner(model, num_blocks=16, block_size=16, max_model_len=128)
        runner.forward([ForwardItem("s", 0, prompt[:40])])
        return runner.forward([ForwardItem("s", 40, prompt[40:45], 5)])[0]

    with_ops = run()
    monkeypatch.setenv(decode_ops.ENV_SWITCH, "0")
    decode_ops.load.cache_clear()
    try:
        without = run()
    finally:
        monkeypatch.undo()
        decode_ops.load.cache_clear()
    torch.testing.assert_close(with_ops, without, rtol=1e-4, atol=1e-4)


def test_silu_mul_and_store_kv_match_torch():
    g = torch.Generator().manual_seed(3)
    gate_up = torch.randn(6, 2 * 1536, generator=g) * 8  # wide range: exp over- and underflow handled
    gate_up[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -88.0])
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(decode_ops.load().silu_mul(gate_up), F.silu(gate) * up, rtol=1e-6, atol=1e-6)
    k_cache, v_cache = torch.zeros(4, 16, 3, 64), torch.zeros(4, 16, 3, 64)
    qkv = torch.randn(3, 960, generator=g)
    key, value = qkv[:, 576:768].view(3, 3, 64), qkv[:, 768:].view(3, 3, 64)  # strided rows, as in the layer
    decode_ops.load().store_kv(key, value, k_cache, v_cache, torch.tensor([17, -1, 63]))
    assert torch.equal(k_cache.view(64, 3, 64)[[17, 63]], key[[0, 2]])
    assert torch.equal(v_cache.view(64, 3, 64)[[17, 63]], value[[0, 2]])
    assert k_cache.view(64, 3, 64).abs().sum(dim=(1, 2)).count_nonzero() == 2  # the padding row wrote nothing
    with pytest.raises(RuntimeError, match="outside the cache"):
        decode_ops.load().store_kv(key, value, k_cache, v_cache, torch.tensor([0, 1, 64]))
