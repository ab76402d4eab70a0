"""The compiled CPU backend: paged attention that follows the block table in place.

Same interface as the reference backend: write the step's new K/V into their slots,
then one kernel call attends the whole flat batch (decode and chunked-prefill rows) by
reading K/V through the block tables, with no gather into a contiguous copy; a layer's
attention window, if any, comes with its call (the kernel reads nothing behind it). The work
list the kernel follows is built once per step (`prepare`, cpu_plan.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedllm.attention.cpu_plan import CpuPlan, plan_work
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.reference import write_kv


class CpuPagedAttention:
    name = "cpu"

    def __init__(self, num_kv_heads: int, scale: float, op: Callable[..., None]) -> None:
        # The kernel reads the head counts and size from the tensors' shapes; the plan
        # needs the KV heads to give each its own prefill items.
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.op = op

    def prepare(self, meta: AttentionMetadata) -> CpuPlan:
        """The step's work list, for the threads of torch's pool (the kernel's)."""
        return plan_work(meta, self.num_kv_heads, torch.get_num_threads())

    def __call__(
        self,
        query: torch.Tensor,  # [T, heads, head_dim]
        key: torch.Tensor,  # [T, kv_heads, head_dim]
        value: torch.Tensor,
        k_cache: torch.Tensor,  # [blocks, block_size, kv_heads, head_dim]
        v_cache: torch.Tensor,
        plan: CpuPlan,
        window: int | None = None,
    ) -> torch.Tensor:
        """`window`: the layer's attention window in tokens (None: full attention)."""
        meta = plan.meta
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
            plan.items,
            plan.merges,
            self.scale,
            window or 0,
        )
        return out.to(query.dtype)
