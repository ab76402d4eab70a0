"""Triton kernels for paged attention on GPUs: the K/V write, the attention over the flat
batch, and the reduction of a context split into parts.

`paged_attention_kernel` runs a program per (query tile, KV head): the tile's tokens times
the query heads that share that KV head are the rows of one matrix, so K/V are loaded once
for all of them. It loops over KV tiles, loading each key's physical block id from the
block table (as int64), K/V with masked loads (`other=0`: unused slots may hold stale data
or NaN), with an online softmax in fp32. With SPLIT, a program covers one part of the
context and leaves its unnormalised result for `merge_splits_kernel`. With HAS_WINDOW (a
layer whose queries see only the keys at positions (p - window, p]), a program starts at
its first row's window, so no key tile wholly behind the window is read, and masks the
rest per row; without it the kernel is compiled exactly as before.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["merge_splits_kernel", "paged_attention_kernel", "write_kv_kernel"]


@triton.jit
def _dot(a, b, FP32: tl.constexpr):
    """a @ b with fp32 accumulation: exact fp32 (no TF32) or in the operands' half dtype."""
    if FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b.to(a.dtype))


@triton.jit
def write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,  # key: [T, KVH, D]
    stride_kh,
    stride_vt,  # value: [T, KVH, D], often a strided view of a fused projection
    stride_vh,
    cache_stride_slot,  # cache viewed as [blocks * block_size, KVH, D]
    cache_stride_h,
    num_kv_heads,
    head_dim,
    KV_HEADS_P: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, KV_HEADS_P)
    d = tl.arange(0, HEAD_DIM_P)
    mask = (h[:, None] < num_kv_heads) & (d[None, :] < head_dim)
    dst = slot * cache_stride_slot + h[:, None] * cache_stride_h + d[None, :]
    k = tl.load(key_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    tl.store(
        k_cache_ptr + dst,
        k.to(k_cache_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
        mask=mask,
    )
    tl.store(
        v_cache_ptr + dst,
        v.to(v_cache_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
        mask=mask,
    )


@triton.jit
def paged_attention_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    query_start_ptr,
    context_lens_ptr,
    tiles_ptr,  # [num_tiles, 2]: sequence index, first query row of the tile
    partial_acc_ptr,  # SPLIT: [tiles, KVH, splits, BLOCK_M, HEAD_DIM_P]
    partial_ml_ptr,  # SPLIT: [tiles, KVH, splits, BLOCK_M, 2]
    scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,  # cache: [blocks, block_size, KVH, D]
    stride_ks,
    stride_kh,
    stride_bt,
    block_size,
    head_dim,
    keys_per_split,
    window,  # HAS_WINDOW: the layer's attention window in tokens
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_FP32: tl.constexpr,  # dots in exact fp32, else in the query's half dtype
    HAS_WINDOW: tl.constexpr,
):
    tile = tl.program_id(0)
    g = tl.program_id(1)
    seq = tl.load(tiles_ptr + tile * 2)
    row0 = tl.load(tiles_ptr + tile * 2 + 1)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    ctx = tl.load(context_lens_ptr + seq)
    first_pos = ctx - q_len

    # Row m of the tile: token m // GROUP_P, query head m % GROUP_P of KV head g.
    offs_m = tl.arange(0, BLOCK_M)
    tok = offs_m // GROUP_P
    hi = offs_m % GROUP_P
    row = row0 + tok
    row_ok = (tok < BLOCK_Q) & (row < q_len) & (hi < GROUP)
    head = g * GROUP + hi
    offs_d = tl.arange(0, HEAD_DIM_P)
    d_ok = offs_d < head_dim
    q_off = (q_start + row).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh
    q = tl.load(q_ptr + q_off + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q = (q.to(tl.float32) * scale).to(q_ptr.dtype.element_ty)
    pos = first_pos + row

    # Keys this tile sees: up to its last row's position (causal), within the context.
    kv_end = tl.minimum(ctx, first_pos + row0 + BLOCK_Q)
    kv_start = 0
    if SPLIT:
        kv_start = tl.program_id(2) * keys_per_split
        kv_end = tl.minimum(kv_end, kv_start + keys_per_split)
    if HAS_WINDOW:  # nothing before the first row's window is read
        kv_start = tl.maximum(kv_start, first_pos + row0 - window + 1)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)
    for start in range(kv_start, kv_end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < kv_end
        block = tl.load(
            block_tables_ptr + seq.to(tl.int64) * stride_bt + offs_n // block_size,
            mask=n_ok,
            other=0,
        ).to(tl.int64)
        kv_off = block * stride_kb + (offs_n % block_size) * stride_ks + g * stride_kh
        kv_mask = n_ok[None, :] & d_ok[:, None]
        k = tl.load(k_cache_ptr + kv_off[None, :] + offs_d[:, None], mask=kv_mask, other=0.0)
        s = _dot(q, k, DOT_FP32)
        visible = n_ok[None, :] & (offs_n[None, :] <= pos[:, None])
        if HAS_WINDOW:
            visible = visible & (offs_n[None, :] > pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that see nothing yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_mask = n_ok[:, None] & d_ok[None, :]
        v = tl.load(v_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=v_mask, other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(q.dtype), v, DOT_FP32)
        m_i = m_new

    if SPLIT:
        part = ((tile * tl.num_programs(1) + g) * tl.num_programs(2) + tl.program_id(2)).to(
            tl.int64
        )
        base = part * BLOCK_M + offs_m
        tl.store(partial_acc_ptr + base[:, None] * HEAD_DIM_P + offs_d[None, :], acc)
        tl.store(partial_ml_ptr + base * 2, m_i)
        tl.store(partial_ml_ptr + base * 2 + 1, l_i)
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_off = (q_start + row).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh
        tl.store(
            out_ptr + o_off + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )


@triton.jit
def merge_splits_kernel(
    out_ptr,
    partial_acc_ptr,
    partial_ml_ptr,
    tiles_ptr,
    query_start_ptr,
    stride_ot,
    stride_oh,
    head_dim,
    num_splits,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
):
    """Combine the splits of decode rows by log-sum-exp (one program per tile and head)."""
    tile = tl.program_id(0)
    g = tl.program_id(1)
    seq = tl.load(tiles_ptr + tile * 2)
    row = tl.load(query_start_ptr + seq)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_P)
    first = (tile * tl.num_programs(1) + g).to(tl.int64) * num_splits
    m_all = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for s in range(0, num_splits):
        base = (first + s) * BLOCK_M + offs_m
        m_all = tl.maximum(m_all, tl.load(partial_ml_ptr + base * 2))
    m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
    l_all = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)
    for s in range(0, num_splits):
        base = (first + s) * BLOCK_M + offs_m
        w = tl.exp(tl.load(partial_ml_ptr + base * 2) - m_safe)
        l_all += w * tl.load(partial_ml_ptr + base * 2 + 1)
        acc += w[:, None] * tl.load(partial_acc_ptr + base[:, None] * HEAD_DIM_P + offs_d[None, :])
    out = acc / tl.where(l_all > 0, l_all, 1.0)[:, None]
    hi = offs_m % GROUP_P
    ok = (offs_m < GROUP_P) & (hi < GROUP)  # a decode tile has one token
    o_off = row.to(tl.int64) * stride_ot + (g * GROUP + hi)[:, None] * stride_oh
    tl.store(
        out_ptr + o_off + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=ok[:, None] & (offs_d[None, :] < head_dim),
    )
