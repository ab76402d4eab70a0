"""PagedKVCache: the physical K/V tensors of every layer, in one preallocated pool.

Layout: [layers, 2 (K and V), num_blocks, block_size, kv_heads, head_dim]. A block of
one layer is contiguous, so gathering a sequence's context is one indexed read per layer,
and copy-on-write copies whole blocks of every layer in one batched operation.
"""

from __future__ import annotations

import torch

from pagedllm.model.config import ModelConfig


class PagedKVCache:
    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        # zeros() maps pages lazily, so an unused pool costs no resident memory.
        self.data = torch.zeros(
            config.num_hidden_layers,
            2,
            num_blocks,
            block_size,
            config.num_key_value_heads,
            config.head_dim,
            dtype=dtype,
            device=device,
        )
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (layer[0], layer[1]) for layer in self.data
        ]

    def copy_blocks(self, pairs: list[tuple[int, int]] | tuple[tuple[int, int], ...]) -> None:
        """Copy blocks src -> dst in every layer (copy-on-write), all pairs at once."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], device=self.data.device)
        dst = torch.tensor([p[1] for p in pairs], device=self.data.device)
        self.data[:, :, dst] = self.data[:, :, src]
