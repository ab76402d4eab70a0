"""The compiled CPU backend: paged attention that follows the block table in place.

Same interface as the reference backend: one kernel call writes the step's new K/V into
their slots, then attends the whole flat batch (decode and chunked-prefill rows) by
reading K/V through the block tables, with no gather into a contiguous copy; a layer's
attention window, if any, comes with its call (the kernel reads nothing behind it). The work
list the kernel follows is built once per step (`prepare`, cpu_plan.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedllm.attention.cpu_plan import CpuPlan, plan_work
from pagedllm.attention.metadata import AttentionMetadata


def _fp32_heads(t: torch.Tensor) -> torch.Tensor:
    """`t` in fp32 (the kernel computes in fp32 whatever the model dtype) with contiguous
    head vectors: the kernel takes any token and head stride, which a valid view can break."""
    t = t.float()
    return t if t.stride(-1) == 1 else t.contiguous()


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
        q, k, v = (_fp32_heads(t) for t in (query, key, value))
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        self.op(
            out,
            q,
            k,
            v,
            meta.slot_mapping,
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
