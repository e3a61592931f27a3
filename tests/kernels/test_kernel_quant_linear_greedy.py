"""kernels/quant_linear.greedy: the greedy ids of a Q8_0 weight, found from an int8 bound over its
16-row copy and the exact rows it picks, equal linear(x, w).max(dim=-1).indices exactly, ties
and near-ties included; where it cannot answer it says so (None) rather than guess. Every pair of
loops a CPU may run: the AVX2 ones (avx512=False, against the AVX2 linear) and, where the CPU has
VNNI, the VNNI bound pass and the AVX2 int8 one (bound_loop()'s choice on AMD), both with the
AVX-512 linear's exact rows."""
from __future__ import annotations

import pytest
import torch

from specsplit.kernels import quant_linear
from specsplit.kernels.quant_linear import QuantWeight
from tests.kernels.test_kernel_quant_linear import random_blocks
from tests.kernels.test_kernel_quant_linear_int8 import LOOPS  # avx512: the AVX2 loops, then VNNI where it runs

pytestmark = pytest.mark.skipif(quant_linear.load() is None, reason="no quantized kernel here (AVX2, FMA, F16C)")
# (avx512, bound): the linear's loop for the exact rows, and the bound pass's loop
GREEDY_LOOPS = [(avx512, bound) for avx512 in LOOPS for bound in ((None,) if not avx512 else ("vnni", "avx2"))]


def argmax_of_linear(x: torch.Tensor, w: QuantWeight, avx512: bool) -> torch.Tensor:
    return quant_linear.linear(x, w, avx512=avx512).max(dim=-1).indices


def with_rows(w: QuantWeight, src: int, dst: list[int]) -> QuantWeight:
    """w with row src's bytes copied over the rows dst (identical rows: exact ties)."""
    blocks = w.blocks.clone()
    blocks[dst] = blocks[src].clone()
    return QuantWeight(blocks, w.qtype, w.in_features)


@pytest.mark.parametrize("avx512, bound", GREEDY_LOOPS)
@pytest.mark.parametrize("k", [32, 96, 576])
@pytest.mark.parametrize("n", [1, 15, 16, 17, 1000, 4099])
@pytest.mark.parametrize("m", [1, 2, 3])
def test_the_ids_equal_the_argmax_of_the_linear(m, n, k, avx512, bound):
    w = random_blocks("Q8_0", n, k, seed=n + k)
    copy = quant_linear.greedy_copy(w)
    g = torch.Generator().manual_seed(m * 7 + n)
    for _ in range(4):
        x = torch.randn(m, k, generator=g) * torch.rand(1, k, generator=g) * 3  # blocks of different scales
        ids = quant_linear.greedy(x, w, copy, avx512=avx512, bound=bound)
        assert ids is not None and ids.dtype == torch.int64
        assert torch.equal(ids, argmax_of_linear(x, w, avx512))


@pytest.mark.parametrize("avx512, bound", GREEDY_LOOPS)
def test_a_tie_goes_to_the_first_of_the_tied_rows(avx512, bound):
    w = random_blocks("Q8_0", 3000, 576, seed=3)
    x = torch.randn(2, 576, generator=torch.Generator().manual_seed(1))
    best = int(argmax_of_linear(x, w, avx512)[0])
    tied = with_rows(w, best, [5, best + 1, 2999])  # the same row before and after the maximum
    ids = quant_linear.greedy(x, tied, quant_linear.greedy_copy(tied), avx512=avx512, bound=bound)
    assert torch.equal(ids, argmax_of_linear(x, tied, avx512)) and int(ids[0]) == 5


@pytest.mark.parametrize("avx512, bound", GREEDY_LOOPS)
def test_rows_a_hair_apart_are_told_apart_exactly(avx512, bound):
    """Copies of the maximum's row with one quant moved by one where x is tiny: the logits differ in
    the last bits only, far inside the bound, so the exact rows decide."""
    w = random_blocks("Q8_0", 2000, 576, seed=4)
    x = torch.randn(1, 576, generator=torch.Generator().manual_seed(2))
    x[0, 100] = 1e-6
    best = int(argmax_of_linear(x, w, avx512)[0])
    blocks = w.blocks.clone()
    for j, row in enumerate((7, 900, 1999)):  # quants come first in a split row: byte 100 is weight 100
        blocks[row] = blocks[best]
        blocks[row, 100] = (int(blocks[best, 100]) + j + 1) % 256
    near = QuantWeight(blocks, "Q8_0", 576)
    y = quant_linear.linear(x, near, avx512=avx512)
    assert sorted(y[0].topk(4).indices.tolist()) == sorted([best, 7, 900, 1999])  # the near-tie is real
    assert torch.equal(quant_linear.greedy(x, near, quant_linear.greedy_copy(near), avx512=avx512, bound=bound),
                       y.max(dim=-1).indices)


@pytest.mark.parametrize("avx512, bound", GREEDY_LOOPS)
def test_where_it_cannot_answer_it_returns_none(avx512, bound):
    w = random_blocks("Q8_0", 500, 64, seed=5)
    copy = quant_linear.greedy_copy(w)
    x = torch.randn(3, 64)
    for bad in (float("nan"), float("inf")):
        y = x.clone()
        y[1, 3] = bad
        assert quant_linear.greedy(y, w, copy, avx512=avx512, bound=bound) is None
    assert quant_linear.greedy(torch.randn(4, 64), w, copy, avx512=avx512, bound=bound) is None  # 4+ rows: quant_linear pairs output rows
    assert quant_linear.greedy_copy(random_blocks("Q4_1", 16, 64)) is None
    same = with_rows(random_blocks("Q8_0", 5000, 64, seed=6), 0, list(range(1, 5000)))  # 5000 tied rows
    assert quant_linear.greedy(x, same, quant_linear.greedy_copy(same), avx512=avx512, bound=bound) is None  # past GREEDY_MAX_CANDIDATES


def test_the_copy_holds_the_rows_bytes_and_their_bound_scale():
    w = random_blocks("Q8_0", 20, 64, seed=7)
    copy = quant_linear.greedy_copy(w)
    assert copy.groups.shape == (2, 2 * 544) and copy.cmax.shape == (20,)
    q = w.blocks[:, :64].view(torch.int8).to(torch.int32)  # split rows: the quants first, block by block
    assert torch.equal(copy.cmax, q.view(20, 2, 32).abs().sum(-1).amax(-1).float())
    g = copy.groups.view(2, 2, 544)
    # group 0, block 1, chunk 3 (weights 32 + 12..15), row 5: bytes 64*3 + 4*5 .. + 4, stored as q + 128
    assert torch.equal(g[0, 1, 192 + 20:192 + 24].to(torch.int32) - 128, q[5, 32 + 12:32 + 16])
    assert torch.equal(g[1, 0, 512 + 6:512 + 8], w.blocks[19, 64:66])  # row 19's d of block 0 (fp16)
    assert (g[1, :, 512 + 8:544] == 0).all() and (g[1, :, :512].view(2, 8, 16, 4)[:, :, 4:] == 128).all()  # padding rows: 0


NEEDS_AMX = pytest.mark.skipif(not quant_linear.uses_amx(), reason="no AMX-BF16 here: no head is in the tiles layout")


@NEEDS_AMX
@pytest.mark.parametrize("k", [64, 576])
@pytest.mark.parametrize("n", [16, 1008, 4096])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5])
def test_a_head_in_tiles_gives_the_argmax_of_its_amx_linear(m, n, k):
    """The candidates' groups of 16 rows through the AMX loop: the ids of the whole tiled head's logits."""
    w = random_blocks("Q8_0", n, k, seed=n + k + 1)
    tiles = w.to_tiles()
    copy = quant_linear.greedy_copy(tiles)
    assert torch.equal(copy.groups, quant_linear.greedy_copy(w).groups)  # the copy is of the rows, either layout
    g = torch.Generator().manual_seed(m * 11 + n)
    for _ in range(4):
        x = torch.randn(m, k, generator=g) * torch.rand(1, k, generator=g) * 3
        ids = quant_linear.greedy(x, tiles, copy)
        assert ids is not None and torch.equal(ids, quant_linear.linear(x, tiles).max(dim=-1).indices)


@NEEDS_AMX
def test_a_head_in_tiles_breaks_ties_and_near_ties_as_its_logits_do():
    """Exact ties (copies of the maximum's row, in other groups and in its own) go to the first row;
    copies with one quant moved by one where x is tiny differ in the last bits, which the AMX rows decide."""
    w = random_blocks("Q8_0", 2048, 576, seed=8)
    x = torch.randn(2, 576, generator=torch.Generator().manual_seed(3))
    x[:, 100] = 1e-6
    best = int(quant_linear.linear(x, w.to_tiles()).max(dim=-1).indices[0])
    tied = with_rows(w, best, [5, best ^ 1, 2047]).to_tiles()
    ids = quant_linear.greedy(x, tied, quant_linear.greedy_copy(tied))
    assert torch.equal(ids, quant_linear.linear(x, tied).max(dim=-1).indices) and int(ids[0]) == 5
    blocks = w.blocks.clone()
    for j, row in enumerate((7, 900, 2047)):
        blocks[row] = blocks[best]
        blocks[row, 100] = (int(blocks[best, 100]) + j + 1) % 256
    near = QuantWeight(blocks, "Q8_0", 576).to_tiles()
    y = quant_linear.linear(x, near)
    assert sorted(y[0].topk(4).indices.tolist()) == sorted([best, 7, 900, 2047])
    assert torch.equal(quant_linear.greedy(x, near, quant_linear.greedy_copy(near)), y.max(dim=-1).indices)
    x5 = torch.cat([x, torch.randn(3, 576, generator=torch.Generator().manual_seed(4))])
    x5[:, 100] = 1e-6
    assert torch.equal(quant_linear.greedy(x5, near, quant_linear.greedy_copy(near)),
                       quant_linear.linear(x5, near).max(dim=-1).indices)  # 5 rows: the AMX loop's one pass
    assert quant_linear.greedy(torch.randn(6, 576), near, quant_linear.greedy_copy(near)) is None  # 6+ rows: the logits


@pytest.mark.parametrize("env, vendor, loop", [
    (None, "AuthenticAMD", "avx2"), (None, "GenuineIntel", "vnni"), (None, "", "vnni"), ("auto", "AuthenticAMD", "avx2"),
    ("vnni", "AuthenticAMD", "vnni"), ("AVX2", "GenuineIntel", "avx2"),
])
def test_the_bound_loop_is_avx2_on_amd_unless_told(monkeypatch, env, vendor, loop):
    """bound_loop(): an AMD Zen 4 reads the copy faster with the AVX2 int8 loop than with VNNI
    (docs/kernels.md); other CPUs keep VNNI; SPECSPLIT_QUANT_GREEDY_BOUND overrides either way."""
    monkeypatch.setattr(quant_linear, "cpu_vendor", lambda: vendor)
    if env is None:
        monkeypatch.delenv(quant_linear.ENV_GREEDY_BOUND, raising=False)
    else:
        monkeypatch.setenv(quant_linear.ENV_GREEDY_BOUND, env)
    assert quant_linear.bound_loop() == loop


def test_a_bound_loop_that_does_not_exist_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(quant_linear.ENV_GREEDY_BOUND, "amx")
    with pytest.raises(ValueError, match="SPECSPLIT_QUANT_GREEDY_BOUND='amx': use one of auto, vnni, avx2"):
        quant_linear.bound_loop()
