"""Int8Linear: a drafter's Q8_0 linear with its activations rounded to int8 as well.

y = x @ W^T where W is Q8_0 (int8 quants q, one fp16 scale d per block of 32 weights) and x is
rounded per block of 32 to int8 too (xq, one fp32 scale s): y[m, n] = sum_b d_nb s_mb
sum_j q_nbj xq_mbj, the integer dot products exact (AVX-512 VNNI, or AVX2 where the CPU has no
VNNI: the same bits; llama.cpp's Q8_0 x Q8_0 product). Each output moves by up to greedy's bound
from the fp32 product of the same blocks (measured 0.06-0.3% of the largest sum |w x| on random
weights), so this is NOT the target's function and never runs in the target: only a drafter's
numbers may differ, because they only choose which tokens are proposed (the target verifies
every one).

The weight is held only as the 16-row interleaved copy the loops read
(kernels/quant_linear.group_copy: 34 bytes per 32 weights, like the blocks, plus 4 per row), as
buffers, so the memory meters count it. `weight` is an empty fp32 parameter: callers read its
dtype. A drafter moves its Int8Linears' copies into one huge-page buffer (`into_huge_pages`): the
target's step has pushed them out of every cache by the time the drafter reads them, and in 4 KB
pages each page of the read is a TLB miss too.
"""
from __future__ import annotations

import torch
from torch import nn

from specsplit.kernels import quant_linear
from specsplit.kv import huge_pages


class Int8Linear(nn.Module):
    def __init__(self, w: quant_linear.QuantWeight):
        """w: Q8_0 blocks [out, in] (quant_linear.quantize_q8_0 of a dense weight)."""
        super().__init__()
        copy = quant_linear.group_copy(w)
        if copy is None:
            raise ValueError(f"Int8Linear needs Q8_0 blocks and the quant kernel, got {w.qtype}")
        self.in_features, self.out_features = w.in_features, w.out_features
        self.register_buffer("groups", copy.groups, persistent=False)  # [ceil(out/16), in/32 * 544] uint8
        self.register_buffer("cmax", copy.cmax, persistent=False)  # [out] fp32
        self.weight = nn.Parameter(torch.empty(0), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [M, in] fp32 -> [M, out] fp32
        return quant_linear.int8_linear(x, quant_linear.GroupCopy(self.groups, self.cmax))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, Q8_0 x int8"


def into_huge_pages(linears: list[Int8Linear]) -> None:
    """The linears' copies into one huge-page buffer (kv/huge_pages.py), in the order given (the
    order a step reads them); nothing changes where huge pages are not available."""
    for m, groups in zip(linears, huge_pages.into_huge_pages([m.groups for m in linears])):
        m.groups = groups  # the same bytes (or the same tensor where huge pages are not available)
