"""PagedKVCache: the K/V tensors, addressed through block tables (read) and slot mappings (write)."""
from __future__ import annotations

import torch

from specsplit.kv import huge_pages


class PagedKVCache:
    """One tensor [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim] for all layers.

    Index 0 on dim 1 holds keys, 1 holds values. A slot is block_id * block_size + offset.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        if self.device.type == "cpu":  # in huge pages where the machine has them: a step at context
            # 300 / 600 / 1200 took 12.40 / 15.22 / 18.59 ms against 12.58 / 15.58 / 19.14 in 4 KB pages
            self.data = huge_pages.zeros(shape, dtype, what="KV cache")
        else:
            self.data = torch.zeros(shape, dtype=dtype, device=self.device)
        # each layer's (k, v) views, made once: a step asks for all of them (two index ops each)
        self._layers = [(self.data[i, 0], self.data[i, 1]) for i in range(num_layers)]

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * elem

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) of one layer, each [num_blocks, block_size, num_kv_heads, head_dim]."""
        return self._layers[index]
