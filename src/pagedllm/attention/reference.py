"""The reference paged-attention backend, in pure torch.

It writes the step's new K/V into their slots, then for each group of sequences (its
per-step plan, reference_plan.py) gathers their context through the block tables and runs
one batched scaled-dot-product attention: causal over the new tokens, full over the
cached ones, or within the layer's attention window when it has one (keys at positions
(p - W, p] for a query at p, the convention of transformers). This is the oracle every faster
backend is tested against, and the CPU path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.reference_plan import AttentionGroup, ReferencePlan, plan_groups


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store the new tokens' K/V ([T, kv_heads, head_dim]) into the paged caches."""
    kvh, d = key.shape[1], key.shape[2]
    # A half-precision cache stores the values rounded to its dtype.
    k_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def gather_context(
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    max_context_len: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """[G, max_context_len, kv_heads, head_dim]: each sequence's K (or V) in token order,
    copied into `out` (a flat buffer of at least G * blocks * block elements) when given."""
    g, nb = block_tables.shape
    num_blocks, bs, kvh, d = cache.shape
    flat = cache.view(num_blocks, bs * kvh * d)
    if out is None:
        gathered = flat.index_select(0, block_tables.flatten())
    else:
        gathered = out[: g * nb * bs * kvh * d].view(g * nb, bs * kvh * d)
        torch.index_select(flat, 0, block_tables.flatten(), out=gathered)
    return gathered.view(g, nb * bs, kvh, d)[:, :max_context_len]


class ReferenceAttention:
    """Paged attention with torch ops only; `cache` tensors are [blocks, block_size, kvh, d]."""

    name = "reference"

    def __init__(self, scale: float) -> None:
        # Head counts and size are not kept: the tensors' shapes carry them.
        self.scale = scale
        # Gather buffers reused by every layer and step: a fresh tensor of this size per
        # call costs page faults that took longer than the copy itself (about 7x on a CPU).
        self._workspace: torch.Tensor | None = None

    def _buffers(self, cache: torch.Tensor, group: AttentionGroup) -> tuple[torch.Tensor, ...]:
        g, nb = group.block_tables.shape
        n = g * nb * cache[0].numel()
        ws = self._workspace
        if ws is None or ws.numel() < 2 * n or ws.dtype != cache.dtype or ws.device != cache.device:
            ws = self._workspace = torch.empty(2 * n, dtype=cache.dtype, device=cache.device)
        return ws[:n], ws[n : 2 * n]

    def prepare(self, meta: AttentionMetadata) -> ReferencePlan:
        """The step's padded groups, built once for every layer."""
        return plan_groups(meta)

    def __call__(
        self,
        query: torch.Tensor,  # [T, heads, head_dim]
        key: torch.Tensor,  # [T, kv_heads, head_dim]
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: ReferencePlan,
        window: int | None = None,
    ) -> torch.Tensor:
        """`window`: the layer's attention window in tokens (None: full attention)."""
        write_kv(key, value, k_cache, v_cache, plan.meta.slot_mapping)
        out = torch.empty_like(query)
        for i, group in enumerate(plan.groups):  # a few: decodes by context, prompt chunks
            self._attend(query, k_cache, v_cache, group, plan.bias(i, window), out)
        return out

    def _attend(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        group: AttentionGroup,
        bias: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        q = query[group.token_index].transpose(1, 2)  # [G, heads, Lq, d]
        k_buf, v_buf = self._buffers(k_cache, group)
        length = group.max_context_len
        k = gather_context(k_cache, group.block_tables, length, k_buf).transpose(1, 2)
        v = gather_context(v_cache, group.block_tables, length, v_buf).transpose(1, 2)
        # Unused slots become zeros. In place: k and v are views of this call's own gather
        # buffers, and a new full-context tensor per group and layer cost more than the
        # attention itself. Then a half-precision cache computes in q's dtype.
        k = k.masked_fill_(group.key_pad, 0.0).to(q.dtype)
        v = v.masked_fill_(group.key_pad, 0.0).to(q.dtype)
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=bias.to(q.dtype), scale=self.scale, enable_gqa=True
        ).transpose(1, 2)  # [G, Lq, heads, d]
        if group.is_decode:
            out[group.token_index[:, 0]] = o[:, 0]
        else:
            out[group.token_index[group.query_valid]] = o[group.query_valid]
