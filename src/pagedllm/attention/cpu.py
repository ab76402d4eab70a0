"""The compiled CPU backend: paged attention that follows the block table in place.

Same interface as the reference backend: write the step's new K/V into their slots,
then one kernel call attends the whole flat batch (decode and chunked-prefill rows) by
reading K/V through the block tables, with no gather into a contiguous copy.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.reference import write_kv


class CpuPagedAttention:
    name = "cpu"
    needs_groups = False
    query_tile: int | None = None

    def __init__(self, scale: float, op: Callable[..., None]) -> None:
        # Head counts and size are not kept: the kernel reads them from the tensors' shapes.
        self.scale = scale
        self.op = op

    def __call__(
        self,
        query: torch.Tensor,  # [T, heads, head_dim]
        key: torch.Tensor,  # [T, kv_heads, head_dim]
        value: torch.Tensor,
        k_cache: torch.Tensor,  # [blocks, block_size, kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        write_kv(key, value, k_cache, v_cache, meta.slot_mapping)
        q = query.float()  # the kernel computes in fp32 whatever the model dtype
        # It takes any row and head strides but rejects a head vector that is not
        # contiguous (TORCH_CHECK query.stride(2) == 1), which a valid view can be.
        if q.stride(-1) != 1:
            q = q.contiguous()
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        self.op(
            out,
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.query_start_loc,
            meta.context_lens,
            self.scale,
        )
        return out.to(query.dtype)
