"""The reference backend's per-step plan: sequences in groups, each padded into a
rectangle so that attention is one batched call per group.

Sequences of equal query length class form a group (decodes, and chunks of prompts);
decodes are bucketed by context length so that padding stays small. Built once per step
from the common metadata (`ReferenceAttention.prepare`), read by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedllm.attention.metadata import AttentionMetadata


@dataclass(frozen=True)
class AttentionGroup:
    """Sequences attended together: queries padded to [G, max_query_len]."""

    token_index: torch.Tensor  # [G, Lq] row of each query in the flat batch (pads: 0)
    query_valid: torch.Tensor  # [G, Lq] bool
    block_tables: torch.Tensor  # [G, max_blocks] physical block ids (pads: 0)
    max_context_len: int
    is_decode: bool  # every query length is 1: the output needs no scatter
    # [G, 1, Lq, Lk] additive mask, 0 where a query sees a key and -inf elsewhere: key j is
    # visible to a query at position p iff j <= p (causal in the chunk, all of the cache).
    # Built once per step for every layer; additive because torch's CPU attention has a
    # fast path for it that a boolean mask misses.
    attn_bias: torch.Tensor
    # [G, 1, Lk, 1] key j >= the sequence's context length: slots past it hold anything
    # (stale K/V, or NaN in fresh memory) and must not reach the softmax, even masked.
    # Stored inverted, ready for masked_fill_, so no layer computes the negation again.
    key_pad: torch.Tensor
    # [G, 1, Lq, 1] position of each query (pads: 0), for the masks of windowed layers.
    query_pos: torch.Tensor

    def window_bias(self, window: int) -> torch.Tensor:
        """attn_bias with keys behind the window also masked: key j is visible to a query
        at position p iff p - window < j <= p."""
        keys = torch.arange(self.max_context_len, device=self.attn_bias.device)
        behind = keys[None, None, None, :] <= self.query_pos - window
        return self.attn_bias.masked_fill(behind, float("-inf"))


@dataclass(frozen=True)
class ReferencePlan:
    meta: AttentionMetadata
    groups: tuple[AttentionGroup, ...]
    # (group index, window) -> that group's mask for windowed layers, built by the first
    # such layer of the step and reused by the others.
    window_biases: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)

    def bias(self, index: int, window: int | None) -> torch.Tensor:
        """Group `index`'s additive mask for a layer with this window (None: none)."""
        group = self.groups[index]
        if window is None:
            return group.attn_bias
        key = (index, window)
        if key not in self.window_biases:
            self.window_biases[key] = group.window_bias(window)
        return self.window_biases[key]


def _context_buckets(members: torch.Tensor, context_lens: torch.Tensor) -> list[torch.Tensor]:
    """Split decoding sequences into groups whose longest context is at most twice the
    shortest (or under 256 tokens), so padding to a group's longest context wastes little
    when lengths vary; a handful of groups, never one per sequence."""
    if members.numel() == 0:
        return []
    ctx = context_lens[members]
    order = torch.argsort(ctx)
    sorted_ctx = ctx[order].tolist()
    buckets, start = [], 0
    for i, n in enumerate(sorted_ctx):
        if n > max(2 * sorted_ctx[start], 256):
            buckets.append(members[order[start:i]])
            start = i
    buckets.append(members[order[start:]])
    return buckets


def _group(meta: AttentionMetadata, members: torch.Tensor) -> AttentionGroup:
    qsl, context_lens = meta.host_query_start_loc, meta.host_context_lens
    qlens = qsl[1:] - qsl[:-1]
    g_qlens = qlens[members]
    max_q = int(g_qlens.max())
    offs = torch.arange(max_q)
    valid = offs[None, :] < g_qlens[:, None]
    token_index = torch.where(valid, qsl[members][:, None] + offs[None, :], 0)
    starts = context_lens[members] - g_qlens
    query_pos = torch.where(valid, starts[:, None] + offs[None, :], 0)
    max_ctx = int(context_lens[members].max())
    allowed = torch.arange(max_ctx)[None, None, :] <= query_pos[:, :, None]
    bias = torch.zeros(allowed.shape, dtype=meta.dtype).masked_fill_(~allowed, float("-inf"))
    device = meta.device
    tables = meta.host_block_tables[members][:, : -(-max_ctx // meta.block_size)]
    return AttentionGroup(
        token_index=token_index.to(device),
        query_valid=valid.to(device),
        block_tables=tables.to(device),
        max_context_len=max_ctx,
        is_decode=max_q == 1,
        attn_bias=bias[:, None].to(device),
        key_pad=(torch.arange(max_ctx)[None, :] >= context_lens[members][:, None])[
            :, None, :, None
        ].to(device),
        query_pos=query_pos[:, None, :, None].to(device),
    )


def plan_groups(meta: AttentionMetadata) -> ReferencePlan:
    """The step's groups: decodes by context length, then the prompt chunks together."""
    qsl = meta.host_query_start_loc
    is_decode = (qsl[1:] - qsl[:-1]) == 1
    members = _context_buckets(torch.nonzero(is_decode).flatten(), meta.host_context_lens)
    prompts = torch.nonzero(~is_decode).flatten()
    if prompts.numel():
        members.append(prompts)
    return ReferencePlan(meta, tuple(_group(meta, m) for m in members))
