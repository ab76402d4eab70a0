"""The Triton backend (the default on CUDA): launches the kernels of triton_kernels.py.

A step with prompt chunks runs one kernel over the flat batch with tiles of QUERY_TILE
query tokens (kernels/policy.py); a step of decodes only runs tiles of one token, and
splits each context into parts (merged by a second kernel) when there are too few
programs to fill the device, by the same rule as the CPU kernel. The tile map, the split
and the buffers of the parts are planned once per step (`prepare`), for every layer.
On a CPU the same kernels run under Triton's interpreter (TRITON_INTERPRET=1), which is
how the tests check them without a GPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from pagedllm.attention.metadata import AttentionMetadata, query_tile_starts
from pagedllm.attention.triton_kernels import (
    merge_splits_kernel,
    paged_attention_kernel,
    write_kv_kernel,
)
from pagedllm.kernels.policy import QUERY_TILE, decode_splits

# Triton's interpreter emulates bfloat16 dots poorly: on a CPU every dot runs in fp32.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK_N = 32  # keys per inner step


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class TritonPlan:
    meta: AttentionMetadata
    tiles: torch.Tensor  # [num_tiles, 2]: sequence, first query row of each program's tile
    block_q: int  # query tokens per tile
    block_m: int  # rows of a program: tokens times the query heads of one KV head
    splits: int  # parts of each context (decode-only steps; 1: no split)
    keys_per_split: int
    # Unnormalised parts of split rows, shared by the layers (one runs at a time).
    partial_acc: torch.Tensor | None
    partial_ml: torch.Tensor | None


class TritonPagedAttention:
    name = "triton"

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, device: torch.device
    ) -> None:
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.group = num_heads // num_kv_heads
        self.head_dim_p = _pow2(head_dim)
        if device.type == "cuda":
            props = torch.cuda.get_device_properties(device)
            self.num_sms = props.multi_processor_count
        else:  # the interpreter: any number exercises the same code
            self.num_sms = 4

    def prepare(self, meta: AttentionMetadata) -> TritonPlan:
        """The step's tiles, its split of decode contexts and the buffers of the parts."""
        tiles = torch.from_numpy(query_tile_starts(meta.host_query_start_loc.numpy(), QUERY_TILE))
        tiles = tiles.to(meta.device)
        decode_only = meta.max_query_len == 1
        block_q = 1 if decode_only else QUERY_TILE
        block_m = max(16, block_q * _pow2(self.group))  # tl.dot needs at least 16 rows
        num_tiles = tiles.shape[0]
        splits = 1
        if decode_only:
            programs = num_tiles * self.num_kv_heads
            splits = decode_splits(programs, self.num_sms, meta.max_context_len)
        keys_per_split = -(-meta.max_context_len // splits)
        keys_per_split = -(-keys_per_split // BLOCK_N) * BLOCK_N
        partial_acc = partial_ml = None
        if splits > 1:
            shape = (num_tiles, self.num_kv_heads, splits, block_m)
            on = {"dtype": torch.float32, "device": meta.device}
            partial_acc = torch.empty((*shape, self.head_dim_p), **on)
            partial_ml = torch.empty((*shape, 2), **on)
        return TritonPlan(
            meta, tiles, block_q, block_m, splits, keys_per_split, partial_acc, partial_ml
        )

    def __call__(
        self,
        query: torch.Tensor,  # [T, heads, head_dim]
        key: torch.Tensor,  # [T, kv_heads, head_dim]
        value: torch.Tensor,
        k_cache: torch.Tensor,  # [blocks, block_size, kv_heads, head_dim]
        v_cache: torch.Tensor,
        plan: TritonPlan,
        window: int | None = None,
    ) -> torch.Tensor:
        """`window`: the layer's attention window in tokens (None: full attention)."""
        # The kernels take any row strides but need each head's vector contiguous.
        query, key, value = (
            t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value)
        )
        meta = plan.meta
        self.write_kv(key, value, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(query)
        tiles, splits, num_tiles = plan.tiles, plan.splits, plan.tiles.shape[0]
        group_p = _pow2(self.group)
        partial_acc = out if plan.partial_acc is None else plan.partial_acc  # unused unless split
        partial_ml = out if plan.partial_ml is None else plan.partial_ml
        paged_attention_kernel[(num_tiles, self.num_kv_heads, splits)](
            out,
            query,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.query_start_loc,
            meta.context_lens,
            tiles,
            partial_acc,
            partial_ml,
            self.scale,
            query.stride(0),
            query.stride(1),
            out.stride(0),
            out.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            meta.block_tables.stride(0),
            k_cache.shape[1],
            self.head_dim,
            plan.keys_per_split,
            window or 0,
            GROUP=self.group,
            GROUP_P=group_p,
            BLOCK_Q=plan.block_q,
            BLOCK_M=plan.block_m,
            BLOCK_N=BLOCK_N,
            HEAD_DIM_P=self.head_dim_p,
            SPLIT=splits > 1,
            DOT_FP32=query.dtype == torch.float32 or INTERPRETED,
            HAS_WINDOW=window is not None,
        )
        if splits > 1:
            merge_splits_kernel[(num_tiles, self.num_kv_heads)](
                out,
                partial_acc,
                partial_ml,
                tiles,
                meta.query_start_loc,
                out.stride(0),
                out.stride(1),
                self.head_dim,
                splits,
                GROUP=self.group,
                GROUP_P=group_p,
                BLOCK_M=plan.block_m,
                HEAD_DIM_P=self.head_dim_p,
            )
        return out

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        if key.shape[0] == 0:
            return
        write_kv_kernel[(key.shape[0],)](
            key,
            value,
            k_cache,
            v_cache,
            slot_mapping,
            key.stride(0),
            key.stride(1),
            value.stride(0),
            value.stride(1),
            k_cache.stride(1),
            k_cache.stride(2),
            self.num_kv_heads,
            self.head_dim,
            KV_HEADS_P=_pow2(self.num_kv_heads),
            HEAD_DIM_P=self.head_dim_p,
        )
