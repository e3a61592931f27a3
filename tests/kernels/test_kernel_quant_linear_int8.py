"""kernels/quant_linear.int8_linear: a Q8_0 weight times x rounded to int8 per block, from the
weight's 16-row copy, is the product its docstring defines (checked against that formula written
in float64 torch) and stays within greedy's bound of the fp32 product of the same blocks."""
from __future__ import annotations

import pytest
import torch

from specsplit.kernels import quant_linear
from specsplit.kernels.quant_linear import QuantWeight
from tests.kernels.test_kernel_quant_linear import random_blocks

pytestmark = pytest.mark.skipif(quant_linear.load() is None, reason="no quantized kernel here (AVX2, FMA, F16C)")
# the loops this CPU runs: the AVX2 one everywhere, the VNNI one where the CPU has it
LOOPS = [False] + ([True] if quant_linear.uses_vnni() else [])


def quants_and_scales(w: QuantWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """w's int8 quants as fp32 [N, K] and its fp16 scales as fp32 [N, K/32] (the file's blocks)."""
    n, nb = w.out_features, w.in_features // 32
    b = w.gguf_blocks().view(n, nb, 34)
    d = b[..., :2].contiguous().view(torch.float16).float().view(n, nb)
    q = b[..., 2:].contiguous().view(torch.int8).float().reshape(n, w.in_features)
    return q, d


def int8_reference(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """The docstring's product in float64: xq = round(x * (127 / max|x_b|)) (to nearest even, the
    scale computed in fp32 as the kernel does), y = sum_b d_b s_b sum_j q_j xq_j."""
    q, d = quants_and_scales(w)
    M, K = x.shape
    xb = x.view(M, -1, 32)
    amax = xb.abs().amax(-1)  # [M, nb]
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    xq = torch.round(xb * inv[..., None]).clamp(-127, 127)  # fp32 product, then round half to even
    s = amax / 127.0
    dots = torch.einsum("mbj,nbj->mnb", xq.double(), q.view(q.shape[0], -1, 32).double())  # exact integers
    return (dots * (d.double()[None] * s.double()[:, None])).sum(-1)  # [M, N]


@pytest.mark.parametrize("avx512", LOOPS)
@pytest.mark.parametrize("k", [32, 96, 576, 1536])
@pytest.mark.parametrize("n", [1, 15, 16, 17, 200])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9])
def test_the_product_is_the_int8_formula_and_near_the_fp32_one(m, n, k, avx512):
    w = random_blocks("Q8_0", n, k, seed=n + k)
    copy = quant_linear.group_copy(w)
    g = torch.Generator().manual_seed(m * 7 + n)
    x = torch.randn(m, k, generator=g) * torch.rand(1, k, generator=g) * 3  # blocks of different scales
    y = quant_linear.int8_linear(x, copy, avx512=avx512)
    assert y.shape == (m, n) and y.dtype == torch.float32
    ref = int8_reference(x, w)
    q, d = quants_and_scales(w)
    # the kernel sums per block in fp32: rounding of ~nb ulps of sum_b |d s dot|
    size = (torch.einsum("mbj,nbj->mnb", x.view(m, -1, 32).abs().double(), q.view(n, -1, 32).abs().double())
            * d.abs().double()[None]).sum(-1)
    assert ((y.double() - ref).abs() <= 1e-5 * size + 1e-30).all()
    # and within greedy's bound of the exact product: |y - a| <= C_n / 2 sum_b |d_nb| s_mb
    exact = quant_linear.linear(x, w).double()
    s = x.view(m, -1, 32).abs().amax(-1).double() / 127.0  # [M, nb]
    bound = copy.cmax.double()[None] / 2 * (d.abs().double()[None] * s[:, None]).sum(-1)
    assert ((y.double() - exact).abs() <= bound * 1.05 + 1e-6 * size).all()


@pytest.mark.skipif(not quant_linear.uses_vnni(), reason="one loop here (no AVX-512 VNNI)")
@pytest.mark.parametrize("m", [1, 2, 3, 4, 7])
def test_the_avx2_loop_gives_the_vnni_loops_bits(m):
    """The same integer dot products and the same float operations per output row: the two loops'
    outputs are equal, so a drafter drafts the same tokens on either CPU kind."""
    w = random_blocks("Q8_0", 77, 576, seed=m)
    copy = quant_linear.group_copy(w)
    x = torch.randn(m, 576) * torch.rand(1, 576) * 3
    x[0, :32] = -x[0, :32].abs().max()  # a block whose largest is negative (xq = -127 there)
    assert torch.equal(quant_linear.int8_linear(x, copy, avx512=True), quant_linear.int8_linear(x, copy, avx512=False))


@pytest.mark.parametrize("avx512", LOOPS)
def test_zero_and_tiny_blocks_and_a_bias(avx512):
    w = random_blocks("Q8_0", 40, 96, seed=1)
    x = torch.randn(4, 96)
    x[1] = 0.0  # a zero row: exactly zero
    x[2, 32:64] = 0.0  # a zero block among others
    bias = torch.randn(40)
    y = quant_linear.int8_linear(x[:3], quant_linear.group_copy(w), bias, avx512=avx512)
    assert torch.equal(y[1], bias)
    assert torch.allclose(y - bias, int8_reference(x[:3], w).float(), rtol=1e-5, atol=1e-4)
    # a block of values too small to scale to int8 (greedy refuses such a row) counts as zeros
    x[3, 64:] = 1e-35
    tiny = quant_linear.int8_linear(x[3:], quant_linear.group_copy(w), avx512=avx512)
    x[3, 64:] = 0.0
    assert torch.equal(tiny, quant_linear.int8_linear(x[3:], quant_linear.group_copy(w), avx512=avx512))


@pytest.mark.parametrize("avx512", LOOPS)
def test_a_row_that_is_not_finite_gives_nan_and_leaves_the_others_alone(avx512):
    w = random_blocks("Q8_0", 33, 64, seed=2)
    copy = quant_linear.group_copy(w)
    x = torch.randn(5, 64)
    clean = quant_linear.int8_linear(x, copy, avx512=avx512)
    for bad in (float("nan"), float("inf"), float("-inf")):
        y = x.clone()
        y[2, 40] = bad
        out = quant_linear.int8_linear(y, copy, avx512=avx512)
        assert out[2].isnan().all()
        assert torch.equal(out[[0, 1, 3, 4]], clean[[0, 1, 3, 4]])


def test_bad_shapes_are_refused_with_a_message():
    w = random_blocks("Q8_0", 20, 64, seed=3)
    copy = quant_linear.group_copy(w)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        quant_linear.int8_linear(torch.randn(1, 60), copy)
    with pytest.raises(RuntimeError, match="groups must be"):
        quant_linear.int8_linear(torch.randn(1, 96), copy)  # the copy is for K = 64
    assert quant_linear.group_copy(random_blocks("Q4_1", 16, 64)) is None  # Q8_0 only
