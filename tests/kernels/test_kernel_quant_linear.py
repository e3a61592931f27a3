"""kernels/quant_linear: the C++ kernel over GGUF Q4_0/Q4_1/Q8_0 blocks equals dequantize-then-
F.linear within fp32 summation order, at every row count the engine runs (1..16) and past it, on
both its loops (AVX2, and AVX-512 where the CPU has it); its dequantized values equal gguf-py's
bit for bit, on random blocks and on the real SmolLM2 GGUF file."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from specsplit.kernels import quant_linear
from specsplit.kernels.quant_linear import TYPES, QuantWeight

pytestmark = pytest.mark.skipif(quant_linear.load() is None,
                                reason="no AVX2/FMA/F16C CPU or no C++ compiler: the quantized kernel is off")
ISAS = [False, True] if quant_linear.uses_avx512() else [False]


def random_blocks(qtype: str, n: int, k: int, seed: int = 0) -> QuantWeight:
    """Random but realistic blocks: fp16 scales of either sign around 1e-2, random quants."""
    g = torch.Generator().manual_seed(seed)
    nb, size = k // 32, TYPES[qtype][1]
    b = torch.randint(0, 256, (n, nb, size), dtype=torch.uint8, generator=g)  # [N, nb, B]
    d = (torch.randn(n, nb, 1, generator=g) * 0.01).half()
    b[..., :2] = d.view(torch.uint8)
    if qtype == "Q4_1":
        b[..., 2:4] = (torch.randn(n, nb, 1, generator=g) * 0.05).half().view(torch.uint8)
    return QuantWeight.from_gguf(b.reshape(n, nb * size), qtype, k)


def exact_linear(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:  # [M, N] in float64
    return F.linear(x.double(), quant_linear.reference_dequantize(w).double())


def gguf_py_dequantize(w: QuantWeight) -> torch.Tensor:
    from gguf import GGMLQuantizationType, quants

    return torch.from_numpy(quants.dequantize(w.gguf_blocks().numpy(), GGMLQuantizationType[w.qtype]).astype(np.float32))


@pytest.mark.parametrize("qtype", list(TYPES))
def test_dequantize_equals_gguf_py_bit_for_bit(qtype):
    w = random_blocks(qtype, 37, 128)
    expected = gguf_py_dequantize(w)
    assert torch.equal(quant_linear.reference_dequantize(w), expected)
    assert torch.equal(quant_linear.dequantize(w), expected)
    assert torch.equal(quant_linear.load().quant_dequantize_scalar(w.blocks, TYPES[qtype][0], 128), expected)


def bits(t: torch.Tensor) -> torch.Tensor:
    """fp32 as int32: equal means bit for bit (-0.0 apart from 0.0, which torch.equal takes for
    each other; NaN's payload)."""
    return t.view(torch.int32)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_dequantize_bits_over_every_fp16_scale(qtype):
    """The AVX2 dequantizer computes Q4_1's (d * q) + m as one FMA and Q4_0's q - 8 in bytes: the
    same bits as gguf-py's formulas for every finite fp16 d of either sign (subnormals included),
    each quant 0..15, and m that cancels d * q exactly (zero's sign included)."""
    finite = torch.arange(0, 0x7C00, dtype=torch.int32)  # every finite positive fp16 bit pattern, 0 too
    d = torch.cat([finite, finite | 0x8000]).to(torch.int16).view(torch.float16)  # [61440] of either sign
    n = d.numel()
    g = torch.Generator().manual_seed(21)
    size = TYPES[qtype][1]
    b = torch.randint(0, 256, (n, size), dtype=torch.uint8, generator=g)  # one block per d
    b[:, :2] = d.view(torch.uint8).reshape(n, 2)
    if qtype == "Q4_1":
        q = torch.randint(0, 16, (n,), generator=g).float()
        m = (-(d.float() * q)).half()  # cancels d * q where the fp16 holds it exactly
        some = torch.rand(n, generator=g) < 0.5  # the other half: a random fp16 m of either sign
        m[some] = (torch.randn(int(some.sum()), generator=g) * 10.0 ** torch.randint(-6, 3, (int(some.sum()),),
                                                                                     generator=g)).half()
        b[:, 2:4] = m.view(torch.uint8).reshape(n, 2)
    rows = 64  # 960 rows of 64 blocks
    w = QuantWeight.from_gguf(b.reshape(n // rows, rows * size).contiguous(), qtype, rows * 32)
    expected = gguf_py_dequantize(w)
    assert torch.equal(bits(quant_linear.dequantize(w)), bits(expected))
    assert torch.equal(bits(quant_linear.load().quant_dequantize_scalar(w.blocks, TYPES[qtype][0], rows * 32)),
                       bits(expected))


@pytest.mark.parametrize("qtype", list(TYPES))
@pytest.mark.parametrize("avx512", ISAS)
def test_linear_equals_reference_for_every_row_count(qtype, avx512):
    # N = 131: not a multiple of any block of outputs; K = 160: an odd number of blocks
    w = random_blocks(qtype, 131, 160, seed=1)
    g = torch.Generator().manual_seed(2)
    for m in list(range(1, 17)) + [23]:
        x = torch.randn(m, 160, generator=g)
        y = quant_linear.linear(x, w, avx512=avx512)
        assert y.shape == (m, 131) and y.dtype == torch.float32
        torch.testing.assert_close(y.double(), exact_linear(x, w), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(y, quant_linear.reference(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("avx512", ISAS)
def test_bias_strided_input_and_dequantized_linear(avx512):
    w = random_blocks("Q4_1", 64, 96, seed=3)
    bias = torch.randn(64)
    x = torch.randn(96, 5).t()  # [5, 96], not contiguous
    expected = quant_linear.reference(x.contiguous(), w, bias)
    torch.testing.assert_close(quant_linear.linear(x, w, bias, avx512=avx512), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(quant_linear.dequantized_linear(x, w, bias), expected, rtol=1e-5, atol=1e-5)
    assert quant_linear.linear(torch.zeros(0, 96), w).shape == (0, 64)


@pytest.mark.parametrize("qtype", sorted(TYPES))
def test_dequantized_linear_in_slices_of_output_rows(qtype):
    """A weight larger than the slice budget is copied a slice of rows at a time (the last one
    short): the same function, bias included."""
    w = random_blocks(qtype, 131, 96, seed=4)
    bias = torch.randn(131)
    x = torch.randn(24, 96)
    expected = quant_linear.reference(x, w, bias)
    for rows_per_slice in (1, 16, 50, 130):
        y = quant_linear.dequantized_linear(x, w, bias, chunk_bytes=4 * 96 * rows_per_slice)
        assert y.shape == (24, 131)
        torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)


def test_split_rows_hold_the_file_bytes():
    for qtype in TYPES:
        w = random_blocks(qtype, 5, 96, seed=6)
        assert torch.equal(QuantWeight.from_gguf(w.gguf_blocks(), qtype, 96).blocks, w.blocks)
        assert w.blocks.shape == w.gguf_blocks().shape and not torch.equal(w.blocks, w.gguf_blocks())


def test_weight_shapes_are_checked():
    w = random_blocks("Q8_0", 8, 64)
    with pytest.raises(ValueError, match="do not hold rows"):
        QuantWeight(w.blocks, "Q8_0", 96)
    with pytest.raises(ValueError, match="Q6_K"):
        QuantWeight(w.blocks, "Q6_K", 64)
    with pytest.raises(RuntimeError, match="fp32"):
        quant_linear.linear(torch.zeros(1, 64, dtype=torch.float64), w)
    rows = w.rows(torch.tensor([7, 0]))
    assert torch.equal(quant_linear.dequantize(rows), quant_linear.dequantize(w)[[7, 0]])
    both = QuantWeight.cat([w, rows])
    assert both.out_features == 10 and torch.equal(both.blocks[8:], rows.blocks)
    with pytest.raises(ValueError, match="cannot fuse"):
        QuantWeight.cat([w, random_blocks("Q4_0", 8, 64)])


def test_real_smollm2_tensors():
    """A Q4_1 layer and rows of the Q8_0 embedding of the shipped GGUF file, against gguf-py."""
    gguf = pytest.importorskip("gguf")
    from specsplit.models.registry import ModelNotFound, smollm2_gguf_path

    try:
        path = smollm2_gguf_path()
    except ModelNotFound as e:
        pytest.skip(str(e))
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    g = torch.Generator().manual_seed(4)
    for name, rows in (("blk.3.ffn_down.weight", None), ("blk.0.attn_k.weight", None), ("token_embd.weight", 3000)):
        t = tensors[name]
        data = np.array(t.data[:rows] if rows else t.data)
        w = QuantWeight.from_gguf(torch.from_numpy(data), t.tensor_type.name, int(t.shape[0]))
        expected = torch.from_numpy(gguf.quants.dequantize(data, t.tensor_type))
        assert torch.equal(quant_linear.dequantize(w), expected), name
        for m in (1, 3, 8, 16):
            x = torch.randn(m, w.in_features, generator=g)
            for avx512 in ISAS:
                torch.testing.assert_close(quant_linear.linear(x, w, avx512=avx512), F.linear(x, expected),
                                           rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("avx512", ISAS)
def test_threads_split_output_rows_without_changing_them(avx512):
    """torch's intra-op threads take chunks of output rows (odd chunk ends included): every row is
    computed as on one thread, bit for bit."""
    w = random_blocks("Q4_1", 333, 96, seed=7)
    x = torch.randn(9, 96)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = [quant_linear.linear(x[:m], w, avx512=avx512) for m in (1, 3, 4, 9)]
        torch.set_num_threads(2)
        two = [quant_linear.linear(x[:m], w, avx512=avx512) for m in (1, 3, 4, 9)]
    finally:
        torch.set_num_threads(before)
    for a, b in zip(one, two):
        assert torch.equal(a, b)


def test_quantize_q8_0_gives_back_a_files_blocks_and_bounds_the_error():
    b = random_blocks("Q8_0", 16, 128, seed=5).gguf_blocks().view(16, 4, 34)
    d = b[..., :2].contiguous().view(torch.float16).abs()  # llama.cpp's blocks: d = max|w| / 127 > 0,
    q = b[..., 2:].contiguous().view(torch.int8).clamp(-127, 127)  # q in -127..127, max |q| = 127
    q[..., 0] = 127
    b = torch.cat([d.view(torch.uint8), q.view(torch.uint8)], -1)
    w = QuantWeight.from_gguf(b.reshape(16, -1).contiguous(), "Q8_0", 128)
    dense = quant_linear.reference_dequantize(w)
    again = quant_linear.quantize_q8_0(dense)
    assert torch.equal(again.blocks, w.blocks)
    x = torch.randn(16, 96) * 3
    x[0, :32] = 0.0  # an all-zero block: d = 0, q = 0, no division by zero
    q = quant_linear.quantize_q8_0(x)
    err = (quant_linear.reference_dequantize(q) - x).abs()
    bound = x.reshape(16, 3, 32).abs().amax(-1, keepdim=True) / 127 * 0.5001 + 1e-3  # half a step (+ fp16 d)
    assert bool((err.reshape(16, 3, 32) <= bound).all()) and err[0, :32].max() == 0
    with pytest.raises(ValueError, match="multiple of 32"):
        quant_linear.quantize_q8_0(torch.zeros(2, 40))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_an_embedding_lookup_dequantizes_just_its_rows(qtype):
    """dequantize_rows (one compiled gather from the split rows) gives exactly the rows of the
    whole dequantized weight, in the ids' order, repeats included; an id out of range is refused."""
    w = random_blocks(qtype, 70, 96, seed=11)
    ids = torch.tensor([[5, 0, 69], [5, 33, 1]])
    assert torch.equal(quant_linear.dequantize_rows(w, ids), quant_linear.dequantize(w)[ids.reshape(-1)])
    assert quant_linear.dequantize_rows(w, torch.tensor([], dtype=torch.long)).shape == (0, 96)
    with pytest.raises(RuntimeError, match="out of 70"):
        quant_linear.dequantize_rows(w, torch.tensor([70]))
