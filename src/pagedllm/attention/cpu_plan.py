"""The compiled CPU backend's per-step plan: the kernel's work list, built once per step.

A work item is one sequence, a range of KV heads, a tile of query rows and a range of
keys. A decode row takes all its KV heads at once, so that each block is read front to
back; a prompt chunk gives one item per KV head and tile of QUERY_TILE rows (they are
compute-bound and many). When a step has too few items to keep the threads busy, decode
rows are split along their context (kernels/policy.py's rule) and the kernel merges the
parts. Items run costliest first: causal prefill tiles differ a lot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.attention.metadata import AttentionMetadata, query_tiles
from pagedllm.kernels.policy import QUERY_TILE, decode_splits

# A work item's fields, the columns of `CpuPlan.items` (the kernel reads them in order).
ITEM_FIELDS = ("seq", "head_begin", "head_end", "row0", "rows", "key_begin", "key_end", "partial")


@dataclass(frozen=True)
class CpuPlan:
    meta: AttentionMetadata
    items: torch.Tensor  # [N, 8] int64, ITEM_FIELDS, in the order the threads take them
    merges: torch.Tensor  # [K, 3] int64: sequence, first partial slot, parts of a split row
    splits: int  # parts of the most split decode row (1: nothing was split)


def _items(
    seq: torch.Tensor,
    heads: tuple[torch.Tensor, torch.Tensor],
    row0: torch.Tensor,
    rows: torch.Tensor,
    keys: tuple[torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """Work items as rows of ITEM_FIELDS (none is a split: partial -1)."""
    unsplit = torch.full_like(seq, -1)
    return torch.stack([seq, *heads, row0, rows, *keys, unsplit], dim=1)


def plan_work(meta: AttentionMetadata, num_kv_heads: int, threads: int) -> CpuPlan:
    """The work list of one step for `threads` threads."""
    qsl, ctx = meta.host_query_start_loc, meta.host_context_lens
    qlens = qsl[1:] - qsl[:-1]
    decode = torch.nonzero(qlens == 1).flatten()
    zeros = torch.zeros_like(decode)
    decode_items = _items(
        decode, (zeros, zeros + num_kv_heads), zeros, zeros + 1, (zeros, ctx[decode])
    )
    tiles = query_tiles(qsl, QUERY_TILE)
    tiles = tiles[qlens[tiles[:, 0]] > 1]
    seq = tiles[:, 0].repeat_interleave(num_kv_heads)
    row0 = tiles[:, 1].repeat_interleave(num_kv_heads)
    head = torch.arange(num_kv_heads).repeat(tiles.shape[0])
    rows = torch.clamp(qlens[seq] - row0, max=QUERY_TILE)
    prompt_items = _items(seq, (head, head + 1), row0, rows, (torch.zeros_like(seq), ctx[seq]))
    num_items = decode_items.shape[0] + prompt_items.shape[0]

    parts_rows, merges, next_partial, most = [], [], 0, 1
    # Rows are visited one by one only when the longest could be split: a handful then.
    longest = int(ctx[decode].max()) if decode.numel() else 0
    candidates = decode.tolist() if decode_splits(num_items, threads, longest) > 1 else []
    kept = list(range(len(candidates), decode.numel()))
    for i, b in enumerate(candidates):
        context = int(ctx[b])
        parts = decode_splits(num_items, threads, context)
        if parts < 2:
            kept.append(i)
            continue
        step = -(-context // parts)
        for p in range(parts):
            end = min(context, (p + 1) * step)
            parts_rows.append([b, 0, num_kv_heads, 0, 1, p * step, end, next_partial + p])
        merges.append([b, next_partial, parts])
        next_partial += parts
        most = max(most, parts)
    split_items = torch.tensor(parts_rows, dtype=torch.long).view(-1, len(ITEM_FIELDS))
    unsplit = decode_items[torch.tensor(kept, dtype=torch.long)]
    items = torch.cat([unsplit, split_items, prompt_items])
    cost = items[:, 4] * (items[:, 2] - items[:, 1]) * (items[:, 6] - items[:, 5])
    order = torch.argsort(cost, descending=True, stable=True)
    return CpuPlan(
        meta=meta,
        items=items[order].contiguous(),
        merges=torch.tensor(merges, dtype=torch.long).view(-1, 3),
        splits=most,
    )
