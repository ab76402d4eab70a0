"""LoRA adapters in pages of the KV pool: write an adapter's packed layers in, read them back.

A page is a block id b of the pool: per layer l it spans `data[l, :, b]` (K's and V's
halves of the block). An adapter's layer-l floats fill its pages in order, each page K's
half then V's. A pool of another dtype (bfloat16, float16) holds the float32 values
bit for bit in its bytes (viewed as float32), so an adapter stays float32 whatever the
KV dtype; attention never reads those pages. One layer group only (LoRA refuses more).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedllm.worker.kv_cache import PagedKVCache

FLOAT_BYTES = 4


def page_floats(block_size: int, kv_heads: int, head_dim: int, kv_itemsize: int) -> int:
    """Float32 values one page holds per layer."""
    return 2 * block_size * kv_heads * head_dim * kv_itemsize // FLOAT_BYTES


def pages_for(layer_floats: int, page: int) -> int:
    """Pages an adapter of `layer_floats` floats per layer takes."""
    return -(-layer_floats // page)


def _halves(cache: PagedKVCache) -> torch.Tensor:
    """The pool as float32 [layers, 2, blocks, floats per half page]."""
    data = cache.data
    flat = data.view(*data.shape[:3], -1)
    return flat if data.dtype == torch.float32 else flat.view(torch.float32)


def write_adapter(cache: PagedKVCache, packed: torch.Tensor, pages: Sequence[int]) -> None:
    """Write `packed` [layers, floats] (LoRAAdapter.pack) into `pages` of `cache`."""
    halves = _halves(cache)
    layers, half = halves.shape[0], halves.shape[-1]
    if packed.shape[1] > 2 * half * len(pages):
        raise ValueError(f"{packed.shape[1]} floats a layer do not fit {len(pages)} pages")
    buf = torch.zeros(layers, len(pages) * 2 * half, device=halves.device)
    buf[:, : packed.shape[1]] = packed.to(device=halves.device, dtype=torch.float32)
    index = torch.tensor(list(pages), dtype=torch.long, device=halves.device)
    halves[:, :, index] = buf.view(layers, len(pages), 2, half).transpose(1, 2)


def read_adapter(cache: PagedKVCache, pages: Sequence[int], floats: int) -> torch.Tensor:
    """The first `floats` floats of each layer written into `pages`: [layers, floats]."""
    halves = _halves(cache)
    index = torch.tensor(list(pages), dtype=torch.long, device=halves.device)
    got = halves[:, :, index].transpose(1, 2).reshape(halves.shape[0], -1)
    return got[:, :floats]
