"""Paged reference attention against dense scaled-dot-product attention, with block
tables of shuffled, non-contiguous physical blocks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.attention.metadata import build_attention_metadata
from pagedllm.attention.reference import ReferenceAttention

HEADS, KV_HEADS, DIM = 6, 2, 16


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """q [Lq, h, d] at positions start.., k/v [start+Lq, kvh, d]: causal, GQA by repeat."""
    group = HEADS // KV_HEADS
    kk = k.repeat_interleave(group, dim=1).transpose(0, 1)
    vv = v.repeat_interleave(group, dim=1).transpose(0, 1)
    qpos = torch.arange(start, start + q.shape[0])[:, None]
    mask = torch.arange(k.shape[0])[None, :] <= qpos
    return F.scaled_dot_product_attention(
        q.transpose(0, 1), kk, vv, attn_mask=mask, scale=DIM**-0.5
    ).transpose(0, 1)


SHORT = [(0, 7), (5, 1), (17, 1), (9, 6), (0, 1), (31, 1), (3, 13)]
# Decodes whose contexts differ by far more than 2x land in several groups.
LONG = [(300, 1), (5, 1), (1500, 1), (700, 1), (260, 4), (40, 1), (600, 1)]


@pytest.mark.parametrize(
    ("block_size", "shapes"), [(1, SHORT), (4, SHORT), (16, SHORT), (16, LONG), (8, LONG)]
)
def test_paged_equals_dense_with_shuffled_blocks(block_size: int, shapes) -> None:
    """shapes: (tokens already cached, new tokens) per sequence: decodes, fresh prompts
    and later chunks of prompts."""
    g = torch.Generator().manual_seed(block_size)
    num_blocks = sum(-(-(c + n) // block_size) for c, n in shapes) + 5
    perm = torch.randperm(num_blocks, generator=g).tolist()
    k_cache = torch.zeros(num_blocks, block_size, KV_HEADS, DIM)
    v_cache = torch.zeros_like(k_cache)
    tables, full_k, full_v = [], [], []
    for cached, new in shapes:
        n_blocks = -(-(cached + new) // block_size)
        table = [perm.pop() for _ in range(n_blocks)]
        tables.append(table)
        k = torch.randn(cached + new, KV_HEADS, DIM, generator=g)
        v = torch.randn(cached + new, KV_HEADS, DIM, generator=g)
        for pos in range(cached):  # the cached part is already in the pool
            k_cache[table[pos // block_size], pos % block_size] = k[pos]
            v_cache[table[pos // block_size], pos % block_size] = v[pos]
        full_k.append(k)
        full_v.append(v)
    assert sorted(b for t in tables for b in t) != list(range(sum(map(len, tables))))
    meta = build_attention_metadata(
        start_positions=[c for c, _ in shapes],
        query_lens=[n for _, n in shapes],
        block_tables=tables,
        logits_seq_indices=range(len(shapes)),
        block_size=block_size,
    )
    reference = ReferenceAttention(DIM**-0.5)
    plan = reference.prepare(meta)
    if shapes is LONG:
        assert sum(grp.is_decode for grp in plan.groups) >= 3
    q = torch.randn(meta.num_tokens, HEADS, DIM, generator=g)
    new_k = torch.cat([k[c:] for k, (c, _) in zip(full_k, shapes, strict=True)])
    new_v = torch.cat([v[c:] for v, (c, _) in zip(full_v, shapes, strict=True)])
    out = reference(q, new_k, new_v, k_cache, v_cache, plan)

    row = 0
    for (cached, new), k, v in zip(shapes, full_k, full_v, strict=True):
        expected = dense_attention(q[row : row + new], k, v, cached)
        torch.testing.assert_close(out[row : row + new], expected, atol=1e-5, rtol=1e-5)
        row += new
    # The new tokens' K/V landed in their slots.
    for (cached, new), table, k in zip(shapes, tables, full_k, strict=True):
        for pos in range(cached, cached + new):
            assert torch.equal(k_cache[table[pos // block_size], pos % block_size], k[pos])


def test_metadata_slots_and_logits_rows() -> None:
    meta = build_attention_metadata(
        start_positions=[0, 6],
        query_lens=[3, 1],
        block_tables=[[7], [2, 5]],
        logits_seq_indices=[0, 1],
        block_size=4,
    )
    assert meta.slot_mapping.tolist() == [28, 29, 30, 22]
    assert meta.positions.tolist() == [0, 1, 2, 6]
    assert meta.logits_indices.tolist() == [2, 3]
    assert meta.context_lens.tolist() == [3, 7]
    assert [g.is_decode for g in ReferenceAttention(1.0).prepare(meta).groups] == [True, False]
