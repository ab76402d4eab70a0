"""Random paged-attention problems for comparing backends with the reference.

A case is a flat batch of sequences, each with some tokens already cached and some new
ones (decodes, whole prompts, later chunks of prompts), in shuffled physical blocks of a
pool whose unused slots hold stale values and NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.attention.metadata import AttentionMetadata, build_attention_metadata


@dataclass
class Case:
    query: torch.Tensor  # [T, heads, d]
    key: torch.Tensor  # [T, kv_heads, d], the new tokens'
    value: torch.Tensor
    k_cache: torch.Tensor  # [blocks, block_size, kv_heads, d]
    v_cache: torch.Tensor
    meta: AttentionMetadata
    scale: float

    def fresh_caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the pool, for a backend that writes the new K/V into it."""
        return self.k_cache.clone(), self.v_cache.clone()

    def poisoned_caches(self, window: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the pool with NaN in every cached slot behind the window of each
        sequence's first new token: a kernel that reads none of them stays finite."""
        k, v = self.fresh_caches()
        meta, bs = self.meta, self.meta.block_size
        qsl = meta.host_query_start_loc
        for i, ctx in enumerate(meta.host_context_lens.tolist()):
            first = ctx - int(qsl[i + 1] - qsl[i])  # position of the first new token
            for pos in range(max(0, first - window + 1)):
                block = int(meta.host_block_tables[i, pos // bs])
                k[block, pos % bs] = float("nan")
                v[block, pos % bs] = float("nan")
        return k, v


def make_case(
    shapes: list[tuple[int, int]],
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    cache_dtype: torch.dtype | None = None,
    device: str = "cpu",
) -> Case:
    """shapes: (tokens already cached, new tokens) per sequence."""
    g = torch.Generator().manual_seed(seed)
    cache_dtype = cache_dtype or dtype
    num_blocks = sum(-(-(c + n) // block_size) for c, n in shapes) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    # Stale values everywhere, NaN in some slots: a kernel must never read an unused slot.
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g) * 50
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g) * 50
    nan = torch.rand(num_blocks, block_size, generator=g) < 0.3
    k_cache[nan] = float("nan")
    v_cache[nan] = float("nan")
    tables, new_k, new_v = [], [], []
    for cached, new in shapes:
        table = [perm.pop() for _ in range(-(-(cached + new) // block_size))]
        tables.append(table)
        # Values the cache dtype holds exactly: backends then agree on what they wrote,
        # whatever rounding their conversion uses.
        k = torch.randn(cached + new, kv_heads, head_dim, generator=g).to(cache_dtype).float()
        v = torch.randn(cached + new, kv_heads, head_dim, generator=g).to(cache_dtype).float()
        for pos in range(cached):
            k_cache[table[pos // block_size], pos % block_size] = k[pos]
            v_cache[table[pos // block_size], pos % block_size] = v[pos]
        new_k.append(k[cached:])
        new_v.append(v[cached:])
    meta = build_attention_metadata(
        start_positions=[c for c, _ in shapes],
        query_lens=[n for _, n in shapes],
        block_tables=tables,
        logits_seq_indices=range(len(shapes)),
        block_size=block_size,
        device=device,
        dtype=dtype,
    )
    query = torch.randn(meta.num_tokens, heads, head_dim, generator=g)
    # In the model, V is a strided view of the fused QKV projection: so it is here.
    fused = torch.cat([torch.cat(new_k), torch.cat(new_v)], dim=-1).to(device, dtype)
    return Case(
        query=query.to(device, dtype),
        key=fused[..., :head_dim].contiguous(),
        value=fused[..., head_dim:],
        k_cache=k_cache.to(device, cache_dtype),
        v_cache=v_cache.to(device, cache_dtype),
        meta=meta,
        scale=head_dim**-0.5,
    )
