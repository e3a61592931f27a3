"""CPU linear kernels by row count (specsplit/models/cpu_linear.py): packed results equal the
dense ones within rounding, each table keeps only the copies it uses and counts their bytes, the
timed policy returns a table for every row count it will run, and the switches work."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specsplit.kernels import skinny_linear
from specsplit.models import cpu_linear
from specsplit.models.llama import Linear
from specsplit.models.loader import load_model
from specsplit.models.runner import ForwardItem, ModelRunner

pytestmark = pytest.mark.skipif(not cpu_linear.supported("cpu", torch.float32), reason="torch without oneDNN")
BF16 = cpu_linear.supported("cpu", torch.bfloat16)


def _load(path, monkeypatch, policy: str, dtype=torch.float32):
    monkeypatch.setenv(cpu_linear.ENV_POLICY, policy)
    return load_model(str(path), dtype=dtype, show_progress=False).model


def _logits(model, prompts, qs):
    """Prefill several sequences, then decode/verify-shaped steps; all logits, in order."""
    runner = ModelRunner(model, num_blocks=64, block_size=4, max_model_len=256)
    out = runner.forward([ForwardItem(f"s{i}", 0, p, num_logits=len(p)) for i, p in enumerate(prompts)])
    lens = [len(p) for p in prompts]
    g = torch.Generator().manual_seed(3)
    for q in qs:
        new = [torch.randint(0, 256, (q,), generator=g).tolist() for _ in prompts]
        out += runner.forward([ForwardItem(f"s{i}", n, t, num_logits=q) for i, (n, t) in enumerate(zip(lens, new))])
        lens = [n + q for n in lens]
    return out


def _prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 9, 20)]


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])  # untied head; tied head + qkv bias
@pytest.mark.parametrize("policy", ["static", "packed", "auto"])
def test_fp32_kernel_choice_equals_dense_within_rounding(fixture, policy, request, monkeypatch):
    path = request.getfixturevalue(fixture)
    dense, chosen = _load(path, monkeypatch, "dense"), _load(path, monkeypatch, policy)
    assert dense.untracked_weight_bytes == 0 and not dense.kernel_tables
    # 1 row (decode), 4 and 2 rows per sequence (verify) in batches of 3: every table entry is hit
    for a, b in zip(_logits(dense, _prompts(), (1, 4, 2)), _logits(chosen, _prompts(), (1, 4, 2))):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not BF16, reason="this CPU/torch has no oneDNN bf16 support")
@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
def test_bf16_packed_equals_dense(fixture, request, monkeypatch):
    path = request.getfixturevalue(fixture)
    dense = _load(path, monkeypatch, "dense", torch.bfloat16)
    packed = _load(path, monkeypatch, "static", torch.bfloat16)
    assert packed.untracked_weight_bytes > 0
    for a, b in zip(_logits(dense, _prompts(), (1, 4, 2)), _logits(packed, _prompts(), (1, 4, 2))):
        # Same bf16 products and fp32 accumulation; a different blocking may round the last bit
        # of a bf16 output differently, which is all this tolerance allows.
        torch.testing.assert_close(b, a, atol=0.02 * float(a.abs().max()), rtol=0)
        assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.95


def test_static_fp32_keeps_both_copies_and_counts_the_packed_ones(tiny_llama, monkeypatch):
    monkeypatch.setenv(skinny_linear.ENV_SWITCH, "0")
    monkeypatch.setattr(skinny_linear, "_tried", True)  # as on a CPU without AVX2/FMA or a compiler
    monkeypatch.setattr(skinny_linear, "_module", None)
    dense, both = _load(tiny_llama, monkeypatch, "dense"), _load(tiny_llama, monkeypatch, "static")
    for name, table in both.kernel_tables.items():
        assert table.kernel(1) == table.kernel(17) == "dense" and table.kernel(2) == table.kernel(16) == "packed", name
        assert table.describe() == "dense 1, packed 2-16, dense 17+"
    linears = [m for m in both.modules() if isinstance(m, Linear) and m is not both.lm_head]
    assert all(m.packed is not None and m.weight.numel() for m in linears)
    lin_bytes = sum(m.weight.numel() * 4 for m in linears)
    head_bytes = dense.head_weight().numel() * 4  # untied head: dense lm_head + its packed copy
    assert both.untracked_weight_bytes == lin_bytes + head_bytes


def test_packed_only_frees_dense_and_recovers_it(tiny_llama, monkeypatch):
    dense, packed = _load(tiny_llama, monkeypatch, "dense"), _load(tiny_llama, monkeypatch, "packed")
    dense_linears = [m for m in dense.modules() if isinstance(m, Linear)]
    packed_linears = [m for m in packed.modules() if isinstance(m, Linear)]
    assert all(m.packed is not None and m.weight.numel() == 0 for m in packed_linears)  # lm_head too
    for d, p in zip(dense_linears, packed_linears):
        assert torch.equal(p.dense_weight(), d.weight)  # the blocked layout round-trips exactly
    assert packed.untracked_weight_bytes == sum(m.weight.numel() * 4 for m in dense_linears)
    assert packed.select_kernels() is False  # already chosen: a second call changes nothing


def test_draft_subset_head_is_packed_and_subset_order_enforced(tiny_llama, monkeypatch):
    subset = torch.arange(0, 256, 2)
    dense = _load(tiny_llama, monkeypatch, "dense")
    dense.set_vocab_subset(subset)
    packed = _load(tiny_llama, monkeypatch, "packed")
    with pytest.raises(RuntimeError, match="before select_kernels"):
        packed.set_vocab_subset(subset)
    monkeypatch.setenv(cpu_linear.ENV_POLICY, "dense")
    sub = load_model(str(tiny_llama), show_progress=False).model
    sub.set_vocab_subset(subset)
    assert sub.select_kernels("packed") and sub._subset_head is None
    for x, y in zip(_logits(dense, [[5, 6, 7, 8, 9]], (1, 3)), _logits(sub, [[5, 6, 7, 8, 9]], (1, 3))):
        assert torch.isinf(y[:, 1::2]).all()
        torch.testing.assert_close(y[:, ::2], x[:, ::2], atol=1e-4, rtol=1e-4)


def test_calibration_times_every_row_count_and_switches_once():
    g = torch.Generator().manual_seed(1)
    ws = [torch.randn(96, 64, generator=g) for _ in range(4)]
    packed = [cpu_linear.pack(w) for w in ws]
    table = cpu_linear.calibrate(("dense", lambda x: [F.linear(x, w) for w in ws]),
                                 ("packed", lambda x: [cpu_linear.packed_linear(x, p, None) for p in packed]),
                                 64, torch.float32, len(ws), cpu_linear.CALIBRATION_ROWS, "dense", budget_s=0.05)
    assert table.rows == cpu_linear.CALIBRATION_ROWS and len(table.timings_us) == len(table.rows)
    assert all(d > 0 and p > 0 for d, p in table.timings_us)
    assert table.by_rows == cpu_linear.crossover(table.timings_us, "dense", "packed")
    assert table.kernel(1000) == "dense"  # prefill past the table: MKL's GEMM


def test_crossover_minimizes_the_summed_time():
    # a noisy middle row count does not split the table: one switch point, the cheapest in sum
    t = [(100, 140), (200, 150), (210, 150), (150, 160), (300, 170)]
    assert cpu_linear.crossover(t) == ("dense", "packed", "packed", "packed", "packed")
    assert cpu_linear.crossover([(1, 2), (1, 2)]) == ("dense", "dense")
    assert cpu_linear.crossover([(3, 2), (3, 2)]) == ("packed", "packed")


def test_row_table_lookup_and_summary():
    t = cpu_linear.RowKernels((1, 2, 4, 8), ("dense", "packed", "packed", "dense"), "dense")
    assert [t.kernel(m) for m in (1, 2, 3, 4, 5, 8, 9)] == ["dense", "packed", "packed", "packed", "dense", "dense", "dense"]
    assert t.describe() == "dense 1, packed 2-4, dense 5+"
    t = cpu_linear.RowKernels((1, 4), ("dense", "packed"), "dense")
    assert t.describe() == "dense 1, packed 2-4, dense 5+" and t.kernel(5) == "dense"
    assert cpu_linear.RowKernels.single("packed").describe() == "packed 1+"
    assert cpu_linear.RowKernels((8,), ("skinny",), "dense").describe() == "skinny 1-8, dense 9+"
    x, w = torch.randn(3, 64), torch.randn(32, 64)
    torch.testing.assert_close(cpu_linear.packed_linear(x, cpu_linear.pack(w), None), F.linear(x, w), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(skinny_linear.load() is None, reason="no AVX2/FMA or no compiler: the skinny kernel is off")
@pytest.mark.parametrize("m", [1, 2, 3, 5, 6, 7, 8, 13])
@pytest.mark.parametrize("n", [16, 50, 1000])
def test_skinny_kernel_equals_f_linear(m, n):
    g = torch.Generator().manual_seed(m * n)
    x, w, b = torch.randn(m, 96, generator=g), torch.randn(n, 96, generator=g), torch.randn(n, generator=g)
    packed = skinny_linear.pack(w)
    assert packed.shape == (-(-n // 16), 96, 16)
    torch.testing.assert_close(skinny_linear.linear(x, packed, n, b), skinny_linear.reference(x, w, b), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(skinny_linear.linear(x, packed, n), F.linear(x, w), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(skinny_linear.load() is None, reason="no AVX2/FMA or no compiler: the skinny kernel is off")
def test_static_fp32_uses_skinny_for_few_rows_and_counts_its_copies(tiny_llama, monkeypatch):
    from specsplit.kv.meters import tensor_storage_bytes

    dense, model = _load(tiny_llama, monkeypatch, "dense"), _load(tiny_llama, monkeypatch, "static")
    for name, table in model.kernel_tables.items():
        assert table.describe() == "skinny 1-8, dense 9+", name
    assert model.untracked_weight_bytes == 0  # the skinny copies are ordinary tensors: tracked
    lin = [m for m in model.modules() if isinstance(m, Linear) and m is not model.lm_head]
    assert all(m.skinny is not None and m.packed is None and m.weight.numel() for m in lin)
    extra = tensor_storage_bytes(model) - tensor_storage_bytes(dense)
    padded = sum(m.skinny.numel() * 4 for m in lin) + model.head_skinny.numel() * 4
    assert extra == padded  # every blocked copy, the head's included, is seen by the memory count


def test_switches(monkeypatch):
    monkeypatch.setenv(cpu_linear.ENV_SWITCH, "0")
    assert cpu_linear.policy() == "dense"
    monkeypatch.setenv(cpu_linear.ENV_SWITCH, "1")
    monkeypatch.setenv(cpu_linear.ENV_POLICY, "nonsense")
    with pytest.raises(ValueError, match="auto, static, dense, packed"):
        cpu_linear.policy()
    assert cpu_linear.supported("cpu", torch.float32)
    assert not cpu_linear.supported("cpu", torch.float16)
    assert not cpu_linear.supported("meta", torch.float32)
