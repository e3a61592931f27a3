"""models/gguf_native: the shipped SmolLM2 GGUF run at its own width (`weights="native"`) is the
same function as today's dequantized fp32 model: the same weights bit for bit once dequantized
(q/k rows un-permuted as transformers does), logits within fp32 rounding at every row count,
the same greedy tokens; its weights take a fraction of the bytes; without the kernel it loads
dense as before."""
from __future__ import annotations

import pytest
import torch

from specsplit.kernels import quant_linear
from specsplit.kv import huge_pages
from specsplit.kv.meters import tensor_storage_bytes
from specsplit.models import cpu_linear
from specsplit.models.gguf_native import QuantEmbedding, reverse_permute_rows
from specsplit.models.loader import load_model
from specsplit.models.runner import ForwardItem, ModelRunner
from tests.helpers.gguf import NEEDS_GGUF, NEEDS_QUANT_KERNEL

pytestmark = [NEEDS_GGUF, NEEDS_QUANT_KERNEL]


@pytest.fixture(scope="module")
def models():
    mp = pytest.MonkeyPatch()
    mp.setenv(cpu_linear.ENV_POLICY, "static")  # no timing: deterministic tables, a fast load
    try:
        native = load_model("smollm2-135m", show_progress=False)
        dense = load_model("smollm2-135m", show_progress=False, weights="fp32")
    finally:
        mp.undo()
    return native, dense


def test_native_holds_the_file_blocks(models):
    native, dense = models
    assert native.weights.startswith("native Q4_1 x120, Q8_0 x1")
    assert dense.weights == "fp32"
    layer = native.model.layers[0]
    assert all(getattr(layer, a).quant is not None and getattr(layer, a).weight.numel() == 0
               for a in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
    # the AMX tiles layout where that loop runs (all four shapes fit it), else the rows layout
    assert {getattr(layer, a).quant.layout for a in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")} == {
        "tiles" if quant_linear.uses_amx() else "rows"}
    assert ("AMX tiles for 121 of 121" in native.weights) == quant_linear.uses_amx()
    assert native.model.embed_tokens.quant.layout == ("tiles" if quant_linear.uses_amx() else "rows")  # the tied head
    # every block in one huge-page buffer where the machine has them (kv/huge_pages.py)
    if huge_pages.available():
        assert native.weights.endswith("in huge pages)")
        assert len({getattr(native.model.layers[i], a).quant.blocks.untyped_storage().data_ptr()
                    for i in (0, 29) for a in ("qkv_proj", "down_proj")}
                   | {native.model.embed_tokens.blocks.untyped_storage().data_ptr()}) == 1
    assert isinstance(native.model.embed_tokens, QuantEmbedding)
    # the static table: the AMX loop at every row count for tiles (cpu_linear.quant_static_table)
    assert native.model.kernel_tables["head 49152x576 Q8_0"].describe() == (
        "quant 1+" if quant_linear.uses_amx() else "quant 1-16, dequant 17+")
    # 4.5-6.4x fewer weight bytes (Q4_1 layers, Q8_0 embedding, fp32 norms)
    assert tensor_storage_bytes(native.model) < 0.25 * tensor_storage_bytes(dense.model)


def test_auto_times_tiles_at_a_prefill_row_count_too(models):
    """Weights in the AMX tiles layout are timed at TILES_PREFILL_ROWS as well, and its winner serves
    every larger row count (a prefill); in the rows layout past QUANT_ROWS is the dequantized GEMM."""
    layers = [layer.gate_up_proj for layer in models[0].model.layers]
    table = models[0].model._quant_table("auto", layers)
    if quant_linear.uses_amx():
        assert table.rows[-1] == cpu_linear.TILES_PREFILL_ROWS and table.beyond == table.by_rows[-1]
        assert table.kernel(500) == table.kernel(cpu_linear.TILES_PREFILL_ROWS)
    else:
        assert table.rows[-1] == cpu_linear.QUANT_ROWS and table.beyond == cpu_linear.DEQUANT
    assert len(table.timings_us) == len(table.rows) and table.kernel(1) == cpu_linear.QUANT


def test_dequantized_weights_equal_transformers_bit_for_bit(models):
    """q/k rows un-permuted, q|k|v and gate|up fused: every weight as transformers dequantizes it."""
    native, dense = models
    for i in (0, 17, 29):
        a, b = native.model.layers[i], dense.model.layers[i]
        for attr in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            assert torch.equal(getattr(a, attr).dense_weight(), getattr(b, attr).weight), (i, attr)
    ids = torch.tensor([0, 1, 500, 49151])
    assert torch.equal(native.model.embed_tokens(ids), dense.model.embed_tokens(ids))


def test_reverse_permute_rows_is_transformers_reverse_permute():
    rows, n_head = 24, 3
    w = torch.arange(rows * 2).reshape(rows, 2)
    dim = rows // n_head // 2
    expected = w.reshape(n_head, dim, 2, 2).swapaxes(2, 1).reshape(rows, 2)  # transformers' numpy code
    assert torch.equal(w[reverse_permute_rows(rows, n_head)], expected)


def _logits(model, qs):
    """A 40-token prefill (the dequant kernel), then decode/verify-shaped steps (the quant kernel)."""
    runner = ModelRunner(model, num_blocks=32, block_size=16, max_model_len=256)
    prompt = list(range(100, 140))
    out = runner.forward([ForwardItem("s", 0, prompt, num_logits=len(prompt))])
    n, g = len(prompt), torch.Generator().manual_seed(1)
    for q in qs:
        new = torch.randint(0, 49152, (q,), generator=g).tolist()
        out += runner.forward([ForwardItem("s", n, new, num_logits=q)])
        n += q
    return [torch.as_tensor(o) for o in out]


def test_logits_equal_the_fp32_path_within_rounding(models):
    native, dense = models
    rows = [1, 2, 3, 4, 5, 8, 16]
    for a, b in zip(_logits(native.model, rows), _logits(dense.model, rows)):
        assert a.shape == b.shape
        # |logits| ~ 30: 1e-3 is ~3e-5 relative, the fp32 rounding of a 30-layer forward
        torch.testing.assert_close(a, b, rtol=0, atol=1e-3)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def _greedy(model, n: int = 24):
    runner = ModelRunner(model, num_blocks=32, block_size=16, max_model_len=256)
    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 2]
    tok = int(torch.as_tensor(runner.forward([ForwardItem("g", 0, prompt, num_logits=1)])[0]).argmax())
    out, pos = [tok], len(prompt)
    for _ in range(n - 1):
        tok = int(torch.as_tensor(runner.forward([ForwardItem("g", pos, [tok], num_logits=1)])[0]).argmax())
        out.append(tok)
        pos += 1
    return out


def test_greedy_generation_equals_the_fp32_path(models):
    native, dense = models
    assert _greedy(native.model) == _greedy(dense.model)


def test_a_greedy_forward_gives_the_ids_of_the_logits(models):
    """forward(greedy=True) gives greedy_ids of forward()'s logits: through the Q8_0 head's greedy
    copy at 1-3 rows (its bound pass VNNI or AVX2; its bytes counted with the untracked ones),
    through the logits past them and elsewhere. Its bytes are the model's (tensor_storage_bytes)."""
    model = models[0].model
    copy = model._head.greedy_copy
    if quant_linear.greedy_copy(model._head.quant) is not None:  # buffers: the memory meters see them
        assert copy is not None and model.greedy_head_groups is copy.groups and model.greedy_head_cmax is copy.cmax
    runner = ModelRunner(model, num_blocks=32, block_size=16, max_model_len=256)
    g = torch.Generator().manual_seed(5)
    context = torch.randint(0, 49152, (60,), generator=g).tolist()
    runner.forward([ForwardItem("s", 0, context, num_logits=1)])
    for q in (1, 2, 3, 4, 8):
        item = ForwardItem("s", 60, torch.randint(0, 49152, (q,), generator=g).tolist(), num_logits=q)
        ids = runner.forward([item], greedy=True)[0]
        logits = runner.forward([item])[0]
        assert ids.dtype == torch.int64 and torch.equal(ids, logits.max(dim=-1).indices)


def test_without_the_kernel_native_loads_dense(monkeypatch):
    monkeypatch.setattr(quant_linear, "_tried", True)  # as on a CPU without AVX2 or a compiler
    monkeypatch.setattr(quant_linear, "_module", None)
    monkeypatch.setenv(cpu_linear.ENV_POLICY, "dense")
    loaded = load_model("smollm2-135m", show_progress=False)
    assert loaded.weights == "fp32"
    assert loaded.model.layers[0].qkv_proj.quant is None and loaded.model.layers[0].qkv_proj.weight.numel() > 0
    with pytest.raises(ValueError, match="weights 'int3'"):
        load_model("smollm2-135m", show_progress=False, weights="int3")


def test_bf16_weights_are_dense_bf16(monkeypatch):
    monkeypatch.setenv(cpu_linear.ENV_POLICY, "dense")
    loaded = load_model("smollm2-135m", show_progress=False, weights="bf16")
    assert loaded.weights == "bf16" and loaded.model.dtype == torch.bfloat16
    assert loaded.model.layers[0].qkv_proj.quant is None
