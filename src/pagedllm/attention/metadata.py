"""AttentionMetadata: everything attention needs about one step's flat batch of tokens.

Built once per step by the model runner and passed down the forward as an argument (no
global context). The batch is flat: sequence i's new tokens are rows
`query_start_loc[i]:query_start_loc[i+1]`. For the reference backend the sequences are
also split into groups of equal query length class (decodes, and chunks of prompts),
each padded into a rectangle so attention is one batched call per group; decodes are
bucketed by context length so that padding stays small.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


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


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] physical slot of each new token's K/V
    positions: torch.Tensor  # [T]
    query_start_loc: torch.Tensor  # [B+1]
    context_lens: torch.Tensor  # [B]
    block_tables: torch.Tensor  # [B, max_blocks]
    logits_indices: torch.Tensor  # [R] rows whose logits are needed
    groups: tuple[AttentionGroup, ...]
    block_size: int
    num_tokens: int
    max_query_len: int
    max_context_len: int
    # [num_tiles, 2] (sequence, first query row) of each tile of `query_tile` tokens, for
    # kernels that run a program per tile; None unless asked for.
    query_tiles: torch.Tensor | None = None


def _pad(rows: Sequence[Sequence[int]], width: int) -> torch.Tensor:
    out = torch.zeros((len(rows), max(width, 1)), dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            out[i, : len(row)] = torch.as_tensor(row, dtype=torch.long)
    return out


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


def _group(
    members: torch.Tensor,
    qlens: torch.Tensor,
    qsl: torch.Tensor,
    starts: torch.Tensor,
    context_lens: torch.Tensor,
    tables: torch.Tensor,
    block_size: int,
    device: torch.device | str,
    dtype: torch.dtype,
) -> AttentionGroup:
    g_qlens = qlens[members]
    max_q = int(g_qlens.max())
    offs = torch.arange(max_q)
    valid = offs[None, :] < g_qlens[:, None]
    token_index = torch.where(valid, qsl[members][:, None] + offs[None, :], 0)
    query_pos = torch.where(valid, starts[members][:, None] + offs[None, :], 0)
    max_ctx = int(context_lens[members].max())
    allowed = torch.arange(max_ctx)[None, None, :] <= query_pos[:, :, None]
    bias = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))
    return AttentionGroup(
        token_index=token_index.to(device),
        query_valid=valid.to(device),
        block_tables=tables[members][:, : -(-max_ctx // block_size)].to(device),
        max_context_len=max_ctx,
        is_decode=max_q == 1,
        attn_bias=bias[:, None].to(device),
        key_pad=(torch.arange(max_ctx)[None, :] >= context_lens[members][:, None])[
            :, None, :, None
        ].to(device),
    )


def build_attention_metadata(
    start_positions: Sequence[int],
    query_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    logits_seq_indices: Sequence[int],
    block_size: int,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    with_groups: bool = True,
    query_tile: int | None = None,
) -> AttentionMetadata:
    """Metadata for sequences that compute `query_lens[i]` tokens from `start_positions[i]`.

    `with_groups` builds the padded groups the reference backend attends over; kernels
    that follow the block table themselves do without them, and may ask for the query
    split into tiles of `query_tile` tokens instead."""
    num_seqs = len(query_lens)
    starts = torch.as_tensor(start_positions, dtype=torch.long)
    qlens = torch.as_tensor(query_lens, dtype=torch.long)
    qsl = torch.zeros(num_seqs + 1, dtype=torch.long)
    torch.cumsum(qlens, 0, out=qsl[1:])
    num_tokens = int(qsl[-1])
    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs), qlens)
    positions = starts[seq_of_token] + torch.arange(num_tokens) - qsl[:-1][seq_of_token]
    max_blocks = max((len(t) for t in block_tables), default=1)
    tables = _pad(block_tables, max_blocks)
    block_of_token = tables[seq_of_token, positions // block_size]
    slot_mapping = block_of_token * block_size + positions % block_size
    context_lens = starts + qlens
    logits_indices = qsl[1:][torch.as_tensor(list(logits_seq_indices), dtype=torch.long)] - 1

    groups = []
    if with_groups:
        is_decode = qlens == 1
        decodes = torch.nonzero(is_decode).flatten()
        prompts = torch.nonzero(~is_decode).flatten()
        members_list = _context_buckets(decodes, context_lens)
        if prompts.numel():
            members_list.append(prompts)
        groups = [
            _group(m, qlens, qsl, starts, context_lens, tables, block_size, device, dtype)
            for m in members_list
        ]
    tiles = None
    if query_tile is not None:
        tiles = torch.tensor(
            [(i, r) for i, n in enumerate(query_lens) for r in range(0, n, query_tile)],
            dtype=torch.long,
        ).view(-1, 2)
    return AttentionMetadata(
        slot_mapping=slot_mapping.to(device),
        positions=positions.to(device),
        query_start_loc=qsl.to(device),
        context_lens=context_lens.to(device),
        block_tables=tables.to(device),
        logits_indices=logits_indices.to(device),
        groups=tuple(groups),
        block_size=block_size,
        num_tokens=num_tokens,
        max_query_len=max(query_lens, default=0),
        max_context_len=int(context_lens.max()) if num_seqs else 0,
        query_tiles=None if tiles is None else tiles.to(device),
    )
