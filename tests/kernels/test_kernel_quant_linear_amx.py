"""kernels/quant_linear, the tiles layout (Q4_0, Q4_1, Q8_0) and its AMX loop: the layout holds the file's bytes (it
converts back to the rows layout exactly, and dequantizes to the same values bit for bit); the AMX
loop equals dequantize-then-F.linear within fp32 rounding at every row count the engine runs; the
loader picks the layout only where the loop runs. The layout tests run on any CPU, the loop's
where AMX-BF16 does (an Intel Xeon from Sapphire Rapids on)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specsplit.kernels import quant_linear
from specsplit.kernels.quant_linear import TILE_TYPES, TYPES, QuantWeight
from tests.kernels.test_kernel_quant_linear import bits, exact_linear, random_blocks

NEEDS_KERNEL = pytest.mark.skipif(quant_linear.load() is None, reason="the quantized kernel is not built here")
NEEDS_AMX = pytest.mark.skipif(not quant_linear.uses_amx(), reason="no AMX-BF16 here: the tiles layout is not used")
# (out, in): one pair of blocks, an odd number of pairs (the loop's last pair in the other slots),
# the model's shapes' pattern (out a multiple of 16, several groups)
SHAPES = [(16, 64), (48, 192), (80, 576)]


@pytest.mark.parametrize("qtype", TILE_TYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_tiles_hold_the_same_bytes(qtype, shape):
    w = random_blocks(qtype, *shape, seed=3)
    t = w.to_tiles()
    assert t.layout == "tiles" and t.out_features == w.out_features and t.nbytes == w.nbytes
    assert t.blocks.shape == (shape[0] // 16, w.blocks.numel() // (shape[0] // 16))
    assert torch.equal(t.as_rows().blocks, w.blocks)
    assert torch.equal(t.gguf_blocks(), w.gguf_blocks())
    assert torch.equal(quant_linear.reference_dequantize(t), quant_linear.reference_dequantize(w))
    part = t.slice_rows(16, shape[0])
    assert part.layout == "tiles" and part.out_features == shape[0] - 16
    assert torch.equal(quant_linear.reference_dequantize(part), quant_linear.reference_dequantize(w)[16:])


def test_what_the_tiles_layout_refuses():
    with pytest.raises(ValueError, match="does not fit"):
        random_blocks("Q4_1", 40, 64).to_tiles()  # out not a multiple of 16
    with pytest.raises(ValueError, match="does not fit"):
        random_blocks("Q4_1", 16, 96).to_tiles()  # an odd number of blocks
    t = random_blocks("Q4_0", 48, 64).to_tiles()
    with pytest.raises(ValueError, match="split one"):
        t.slice_rows(8, 48)
    with pytest.raises(ValueError, match="do not hold tiles"):
        QuantWeight(t.blocks, "Q8_0", 64, "tiles")  # Q4_0's bytes read as Q8_0's
    with pytest.raises(ValueError, match="layout"):
        QuantWeight(t.blocks, "Q4_0", 64, "columns")


@pytest.mark.parametrize("qtype", TILE_TYPES)
def test_rows_gathered_from_tiles_are_the_rows_layouts(qtype):
    """An embedding lookup in a tied head's tiles: the rows asked for, in the order asked."""
    w = random_blocks(qtype, 64, 128, seed=9)
    index = torch.tensor([63, 0, 17, 17, 40])
    got = w.to_tiles().rows(index)
    assert got.layout == "rows" and torch.equal(got.blocks, w.rows(index).blocks)


@NEEDS_KERNEL
@pytest.mark.parametrize("qtype", TILE_TYPES)
def test_the_compiled_dequantizer_reads_tiles_bit_for_bit(qtype):
    w = random_blocks(qtype, 48, 192, seed=4)
    assert torch.equal(quant_linear.dequantize(w.to_tiles()), quant_linear.dequantize(w))


@NEEDS_KERNEL
@pytest.mark.parametrize("qtype", TILE_TYPES)
def test_rows_dequantized_straight_from_tiles(qtype):
    """An embedding lookup (quant_linear.dequantize_rows): the compiled gather from the tiles
    equals the rows layout's rows, bit for bit, in the order asked; a row past the end is refused."""
    w = random_blocks(qtype, 64, 128, seed=10)
    t = w.to_tiles()
    ids = torch.tensor([[63, 0], [17, 17]])
    assert torch.equal(quant_linear.dequantize_rows(t, ids), quant_linear.dequantize(w)[ids.reshape(-1)])
    assert torch.equal(quant_linear.dequantize_rows(w, ids), quant_linear.dequantize(w)[ids.reshape(-1)])
    with pytest.raises(RuntimeError, match="out of 64"):
        quant_linear.dequantize_rows(t, torch.tensor([64]))


# (out, in) for the dequantizer: one group, an odd number of groups, several; one pair of blocks (the
# fewest the tiles hold: in = 32 is refused), the model's 576 and 1536
DEQUANT_SHAPES = [(16, 64), (16, 1536), (48, 64), (48, 576), (80, 1536), (208, 576)]


@NEEDS_KERNEL
@pytest.mark.parametrize("qtype", TILE_TYPES)
@pytest.mark.parametrize("shape", DEQUANT_SHAPES)
def test_tiles_dequantize_to_the_rows_layouts_bits(qtype, shape):
    """quant_dequantize_amx (its AVX-512 loop where the CPU has one) and the row gather: the rows
    layout's values bit for bit, whole and for rows asked in any order."""
    w = random_blocks(qtype, *shape, seed=11)
    t = w.to_tiles()
    dense = quant_linear.dequantize(w)
    assert torch.equal(bits(quant_linear.dequantize(t)), bits(dense))
    ids = torch.randperm(shape[0], generator=torch.Generator().manual_seed(12))
    assert torch.equal(bits(quant_linear.dequantize_rows(t, ids)), bits(dense[ids]))


@NEEDS_KERNEL
@pytest.mark.parametrize("qtype", TILE_TYPES)
def test_tiles_dequantize_any_scale_bits(qtype):
    """Random bytes for the fp16 scales too (subnormals, -0, inf, NaN): the scalar loop's bits."""
    g = torch.Generator().manual_seed(13)
    raw = torch.randint(0, 256, (80, 18 * TYPES[qtype][1]), dtype=torch.uint8, generator=g)
    w = QuantWeight.from_gguf(raw, qtype, 576)
    scalar = quant_linear.load().quant_dequantize_scalar(w.blocks, TYPES[qtype][0], 576)
    assert torch.equal(bits(quant_linear.dequantize(w.to_tiles())), bits(scalar))
    assert torch.equal(bits(quant_linear.dequantize_rows(w.to_tiles(), torch.arange(79, -1, -1))), bits(scalar.flip(0)))


@NEEDS_KERNEL
def test_tiles_dequantize_threads_split_groups_without_changing_them():
    """torch's threads take chunks of 16 groups (here 2.5 chunks): the bits of one thread."""
    t = random_blocks("Q4_1", 16 * 40, 128, seed=14).to_tiles()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = quant_linear.dequantize(t)
        torch.set_num_threads(2)
        two = quant_linear.dequantize(t)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(bits(one), bits(two))


def within_fp32_rounding(y: torch.Tensor, x: torch.Tensor, w: QuantWeight) -> None:
    """|y - the float64 product| <= 1e-6 of sum |x| |w| per output (measured: up to ~8e-8; a wrong
    block, scale or row would be off by the size of the terms)."""
    scale = x.double().abs() @ quant_linear.reference_dequantize(w).double().abs().T  # [M, N]
    err = (y.double() - exact_linear(x, w)).abs()
    assert bool((err <= 1e-6 * scale + 1e-30).all()), float((err / scale).max())


@NEEDS_AMX
@pytest.mark.parametrize("qtype", TILE_TYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_amx_linear_equals_reference_for_every_row_count(qtype, shape):
    """1..16 rows (the 4-bit types' 1-5 with the pieces as tile rows, the rest along K, one pass of
    up to 16 tokens), 23 and 45 (prefill-sized calls: passes of 16 and what is left)."""
    w = random_blocks(qtype, *shape, seed=5)
    t = w.to_tiles()
    g = torch.Generator().manual_seed(6)
    for m in list(range(1, 17)) + [23, 45]:
        x = torch.randn(m, shape[1], generator=g)
        y = quant_linear.linear(x, t)
        assert y.shape == (m, shape[0]) and y.dtype == torch.float32
        within_fp32_rounding(y, x, w)


@NEEDS_AMX
def test_amx_bias_strided_input_bind_and_dequantized_linear():
    w = random_blocks("Q4_1", 80, 128, seed=7)
    t = w.to_tiles()
    x = torch.randn(4, 256)[:, ::2]  # strided: not contiguous
    bias = torch.randn(80)
    expected = F.linear(x, quant_linear.reference_dequantize(w), bias)
    torch.testing.assert_close(quant_linear.linear(x, t, bias), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(quant_linear.bind(t, bias)(x.contiguous()), expected, rtol=1e-5, atol=1e-5)
    # slices of whole groups: 40 rows' worth of bytes rounds to 32 rows, then 16 at the end
    sliced = quant_linear.dequantized_linear(x, t, bias, chunk_bytes=40 * 4 * 128)
    torch.testing.assert_close(sliced, expected, rtol=1e-5, atol=1e-5)


@NEEDS_AMX
def test_amx_threads_split_groups_without_changing_them():
    """torch's intra-op threads take chunks of 16-row groups: every output as on one thread."""
    t = random_blocks("Q4_1", 16 * 13, 128, seed=8).to_tiles()
    x = torch.randn(23, 128)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = [quant_linear.linear(x[:m], t) for m in (1, 5, 7, 23)]
        torch.set_num_threads(2)
        two = [quant_linear.linear(x[:m], t) for m in (1, 5, 7, 23)]
    finally:
        torch.set_num_threads(before)
    for a, b in zip(one, two):
        assert torch.equal(a, b)


@NEEDS_AMX
@pytest.mark.parametrize("qtype", TILE_TYPES)
def test_a_prefill_gives_each_row_the_bits_of_a_decode_row(qtype):
    """A prefill's tokens go in passes of 16 with the pieces along K; a 4-bit type's single row or
    3-row verify has its pieces as tile rows (Q8_0's along K too): each token's outputs have the
    same bits in all of them, whatever pass it falls in."""
    t = random_blocks(qtype, 48, 192, seed=9).to_tiles()
    x = torch.randn(45, 192, generator=torch.Generator().manual_seed(10))
    many = quant_linear.linear(x, t)
    alone = torch.cat([quant_linear.linear(x[i:i + 1], t) for i in range(45)])
    assert torch.equal(many, alone)
    assert torch.equal(many[6:9], quant_linear.linear(x[6:9], t))


@NEEDS_KERNEL
def test_the_loader_picks_tiles_only_where_the_amx_loop_runs(monkeypatch):
    w = random_blocks("Q4_1", 48, 128)
    expected = "tiles" if quant_linear.uses_amx() else "rows"
    assert quant_linear.for_kernel(w).layout == expected
    assert quant_linear.for_kernel(random_blocks("Q8_0", 48, 128)).layout == expected
    assert quant_linear.for_kernel(random_blocks("Q4_1", 40, 128)).layout == "rows"  # out not a multiple of 16
    assert quant_linear.for_kernel(random_blocks("Q8_0", 48, 96)).layout == "rows"  # an odd number of blocks
    monkeypatch.setenv(quant_linear.ENV_AMX, "0")
    assert not quant_linear.uses_amx() and quant_linear.for_kernel(w) is w
