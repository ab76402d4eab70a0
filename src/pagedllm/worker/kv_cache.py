"""PagedKVCache: the physical K/V tensors of every layer, in one preallocated pool.

Layout: [group_size, 2 (K and V), num_blocks, block_size, kv_heads, head_dim]. The layers
form groups (the block manager's, kv/groups.py, handed over as plain layer lists) of
`group_size` layers each; layer `groups[g].layers[j]` keeps
its K/V in slot j of the blocks group g's tables name, and a block id belongs to one group
at a time. A model of one kind is one group of every layer: [layers, 2, ...]. With a
window group the pool has one more block past the others: the null block, which tables
name behind their window and which nothing writes. A block of one layer is contiguous, so
gathering a sequence's context is one indexed read per layer, and copy-on-write copies
whole blocks of every slot in one batched operation.
"""

from __future__ import annotations

from collections.abc import Sequence

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
        layer_groups: Sequence[Sequence[int]] | None = None,
        null_block: bool = False,
    ) -> None:
        """`layer_groups[g]`: the layers of group g (None: one group of every layer);
        `null_block`: one block more, past `num_blocks`, for the null block."""
        num_layers = config.num_hidden_layers
        groups = [tuple(g) for g in layer_groups or [range(num_layers)]]
        slots = {layer: (g, j) for g, layers in enumerate(groups) for j, layer in enumerate(layers)}
        if sorted(slots) != list(range(num_layers)) or sum(map(len, groups)) != num_layers:
            raise ValueError(f"the layer groups must cover layers 0..{num_layers - 1} once each")
        sizes = {len(g) for g in groups}
        if len(sizes) != 1:
            raise ValueError(f"every layer group must have the same number of layers, got {sizes}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # zeros() maps pages lazily, so an unused pool costs no resident memory; the null
        # block stays zeros (finite) for a backend that gathers it before masking.
        self.data = torch.zeros(
            sizes.pop(),
            2,
            num_blocks + (1 if null_block else 0),
            block_size,
            config.num_key_value_heads,
            config.head_dim,
            dtype=dtype,
            device=device,
        )
        self.layer_group: tuple[int, ...] = tuple(slots[i][0] for i in range(num_layers))
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (self.data[slots[i][1], 0], self.data[slots[i][1], 1]) for i in range(num_layers)
        ]

    def copy_blocks(self, pairs: list[tuple[int, int]] | tuple[tuple[int, int], ...]) -> None:
        """Copy blocks src -> dst in every slot (copy-on-write), all pairs at once."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], device=self.data.device)
        dst = torch.tensor([p[1] for p in pairs], device=self.data.device)
        self.data[:, :, dst] = self.data[:, :, src]
