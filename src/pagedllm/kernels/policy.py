"""Work-sharing rules of the kernels, defined once here for every backend and language.

The compiled CPU kernels and the Triton kernels follow the same rules; the C++ sources
never restate them: a rule reaches them as an argument (a work list built from it) or as
a `-D` definition at build time (kernels/cpu.py), so changing a number here changes
every kernel and the build (its cache key covers the flags).

Plain Python, no torch: the rules are arithmetic on counts.
"""

from __future__ import annotations

# Query tokens per work item (a CPU work item, a Triton program) in steps with prompt
# chunks: enough rows to reuse each K/V row loaded, few enough to keep tiles balanced.
QUERY_TILE = 16

# A decode row's context is cut into parts of at least this many keys: below it, merging
# the parts costs more than the parallelism wins.
MIN_KEYS_PER_SPLIT = 256

# Splitting aims at this many work items per worker (thread, streaming multiprocessor),
# so that uneven items still keep every worker busy to the end.
ITEMS_PER_WORKER = 2

# Up to this many rows a linear layer is a matrix-vector product bound by reading the
# weights (the compiled gemv kernels, one template per row count); above it torch's
# blocked GEMM is faster.
GEMV_MAX_ROWS = 8

# Up to this many rows, on a CPU without AVX-512 VNNI, a layer whose weights are packed in
# the AVX2 GEMM's panels reads them there (tiles of these rows by 4 panels, prefetching)
# instead of the row-major gemv: the weights are read once either way, and the panels'
# order streams from memory faster (docs/kernels.md has the figures).
PANEL_GEMV_MAX_ROWS = 2

# From this many input rows on, a linear layer on GGUF blocks of a type with a multi-row
# kernel (Q5_0, Q8_0, Q4_K, Q5_K, Q6_K; Q4_0 and Q4_1 below) unpacks each weight block once for
# several input rows (the "gemm" method of csrc/gguf_linear.cpp) instead of once per row:
# measured faster from 2 rows on, the same at 1 (docs/kernels.md has the figures).
GGUF_GEMM_MIN_ROWS = 2

# Q4_0's and Q4_1's gemm methods interleave 16 weight rows (8 on AVX2) and apply each
# block's scales once for all of them; measured against the one-row dot (Q4_1), it took less
# time from one input row on.
GGUF_Q4_0_Q4_1_GEMM_MIN_ROWS = 1

# Q4_K's and Q6_K's gemm methods (from GGUF_GEMM_MIN_ROWS rows) interleave the weight rows
# likewise from these many input rows on; below, they unpack one weight row at a time for
# all the input rows, with the same arithmetic. Making the interleaved blocks (their
# sub-block scales, Q6_K's high bits) costs more than it saves below these counts
# (docs/kernels.md has the figures).
GGUF_Q4_K_INTERLEAVED_MIN_ROWS = 3
GGUF_Q6_K_INTERLEAVED_MIN_ROWS = 6

# Q4_0, Q4_1 and Q4_K weights are interleaved at load (16 rows at a time, see
# csrc/gguf_interleaved_layout.h) when the kernels build. Up to this many input rows (the
# fewest activation rows any build's pass takes) the kernels read them in place; above, each
# pass over 16 weight rows unpacks them once for all the passes of input rows (measured
# faster there in the AVX2 build, the same in the VNNI one: docs/kernels.md).
GGUF_INTERLEAVED_IN_PLACE_MAX_ROWS = 4


def _parts_wanted(work_items: int, workers: int) -> int:
    """Parts per work item that give every worker ITEMS_PER_WORKER items (one worker
    gains nothing from parts)."""
    if work_items <= 0 or workers <= 1:
        return 1
    return -(-ITEMS_PER_WORKER * workers // work_items)


def decode_splits(work_items: int, workers: int, context_len: int) -> int:
    """Into how many parts a decode row of `context_len` keys is cut when a step has
    `work_items` items for `workers` workers: enough to give every worker
    ITEMS_PER_WORKER items, each part at least MIN_KEYS_PER_SPLIT keys; 1 means no split."""
    return max(1, min(_parts_wanted(work_items, workers), context_len // MIN_KEYS_PER_SPLIT))


def decode_head_splits(work_items: int, workers: int, num_kv_heads: int) -> int:
    """Into how many ranges of its KV heads a decode row is cut when a step has
    `work_items` items for `workers` workers (the CPU kernel): enough to give every worker
    ITEMS_PER_WORKER items, at most one range per KV head; 1 means whole. Unlike parts of
    the context, ranges of heads need no merging, and a short context splits as well."""
    return max(1, min(_parts_wanted(work_items, workers), num_kv_heads))
