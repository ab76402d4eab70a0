"""The compiled CPU backend's per-step plan: the kernel's work list, built once per step.

A work item is one sequence, a range of KV heads, a tile of query rows and a range of
keys. A decode row takes all its KV heads at once, so that each block is read front to
back; a prompt chunk gives one item per KV head and tile of QUERY_TILE rows (they are
compute-bound and many). When a step has too few items to keep the threads busy (one
stream's decode step), each decode row is cut into ranges of its KV heads, or, where its
context is long enough to give more parts, along its context, and the kernel merges those
parts (kernels/policy.py's rules). Items run costliest first: causal prefill tiles differ
a lot.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.attention.metadata import AttentionMetadata, query_tile_starts
from pagedllm.kernels.policy import QUERY_TILE, decode_head_splits, decode_splits

# A work item's fields, the columns of `CpuPlan.items` (the kernel reads them in order).
ITEM_FIELDS = ("seq", "head_begin", "head_end", "row0", "rows", "key_begin", "key_end", "partial")


@dataclass(frozen=True)
class CpuPlan:
    meta: AttentionMetadata
    items: torch.Tensor  # [N, 8] int64, ITEM_FIELDS, in the order the threads take them
    merges: torch.Tensor  # [K, 3] int64: sequence, first partial slot, parts of a split row
    splits: int  # parts of the most split decode row (1: nothing was split)


def plan_work(meta: AttentionMetadata, num_kv_heads: int, threads: int) -> CpuPlan:
    """The work list of one step for `threads` threads."""
    # numpy, not torch: a step's plan is a few dozen operations on arrays of a few
    # elements, and each costs torch several times numpy's dispatch (one stream's plan
    # inside a decode step: about 0.29 ms in torch, 0.13 in numpy).
    qsl, ctx = meta.host_query_start_loc.numpy(), meta.host_context_lens.numpy()
    qlens = qsl[1:] - qsl[:-1]
    decode = np.flatnonzero(qlens == 1)
    tiles = query_tile_starts(qsl, QUERY_TILE)
    tiles = tiles[qlens[tiles[:, 0]] > 1]
    seq = np.repeat(tiles[:, 0], num_kv_heads)
    row0 = np.repeat(tiles[:, 1], num_kv_heads)
    head = np.tile(np.arange(num_kv_heads), tiles.shape[0])
    num_items = decode.size + seq.size
    # A decode row is cut into ranges of its KV heads, or, where its context gives more
    # parts than that, along its context. Rows are visited one by one only when the
    # longest could be cut so: a handful then.
    by_heads = decode_head_splits(num_items, threads, num_kv_heads)
    longest = int(ctx[decode].max()) if decode.size else 0
    candidates = decode.tolist() if decode_splits(num_items, threads, longest) > by_heads else []
    parts = [(b, decode_splits(num_items, threads, int(ctx[b]))) for b in candidates]
    split = [(b, n) for b, n in parts if n > by_heads]
    whole = np.array([b for b, n in parts if n <= by_heads], np.int64) if candidates else decode
    rows = whole.size * by_heads + sum(n for _, n in split) + seq.size
    # The decode rows by ranges of heads, the split ones' parts, then the prompt tiles.
    items = np.empty((rows, len(ITEM_FIELDS)), np.int64)
    end = whole.size * by_heads
    heads = np.arange(by_heads + 1) * num_kv_heads // by_heads
    items[:end] = (0, 0, 0, 0, 1, 0, 0, -1)
    items[:end, 0] = np.repeat(whole, by_heads)
    items[:end, 1], items[:end, 2] = np.tile(heads[:-1], whole.size), np.tile(heads[1:], whole.size)
    items[:end, 6] = ctx[items[:end, 0]]
    merges = np.empty((len(split), 3), np.int64)
    for i, (b, n) in enumerate(split):
        context = int(ctx[b])
        step = -(-context // n)
        first = end - whole.size * by_heads
        keys = np.arange(n) * step
        items[end : end + n] = (b, 0, num_kv_heads, 0, 1, 0, 0, 0)
        items[end : end + n, 5], items[end : end + n, 6] = keys, np.minimum(context, keys + step)
        items[end : end + n, 7] = first + np.arange(n)
        merges[i] = (b, first, n)
        end += n
    prompt = items[end:]
    prompt[:, 0], prompt[:, 1], prompt[:, 2], prompt[:, 3] = seq, head, head + 1, row0
    prompt[:, 4] = np.minimum(qlens[seq] - row0, QUERY_TILE)
    prompt[:, 5], prompt[:, 6], prompt[:, 7] = 0, ctx[seq], -1
    cost = items[:, 4] * (items[:, 2] - items[:, 1]) * (items[:, 6] - items[:, 5])
    order = np.argsort(-cost, kind="stable")  # costliest first; ties keep their order
    return CpuPlan(
        meta=meta,
        items=torch.from_numpy(items[order]),
        merges=torch.from_numpy(merges),
        splits=max((n for _, n in split), default=1),
    )
