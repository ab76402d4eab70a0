"""How long the compiled CPU attention takes for one prompt chunk of one layer: a sequence
with `cached` tokens in the pool and `new` more attending to them (causal among
themselves), per head shape; the median of 7 calls, on torch's threads.
    .venv/bin/python scripts/attention_chunk_speed.py [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedllm.attention.cpu import CpuPagedAttention
from pagedllm.attention.metadata import build_attention_metadata
from pagedllm.kernels.cpu import load_cpu_ops

BLOCK = 16
HEAD_DIM = 64
# (query heads, KV heads, cached tokens, new tokens): SmolLM2-1.7B's heads, then 135M's
CASES = ((32, 32, 0, 512), (32, 32, 1536, 512), (9, 3, 0, 512), (9, 3, 3584, 512))


def chunk_ms(heads: int, kv_heads: int, cached: int, new: int) -> float:
    g = torch.Generator().manual_seed(0)
    blocks = -(-(cached + new) // BLOCK)
    k_cache = torch.randn(blocks, BLOCK, kv_heads, HEAD_DIM, generator=g)
    v_cache = torch.randn(blocks, BLOCK, kv_heads, HEAD_DIM, generator=g)
    meta = build_attention_metadata(
        start_positions=[cached],
        query_lens=[new],
        block_tables=[list(range(blocks))],
        logits_seq_indices=[0],
        block_size=BLOCK,
        device="cpu",
        dtype=torch.float32,
    )
    q = torch.randn(new, heads, HEAD_DIM, generator=g)
    k, v = (torch.randn(new, kv_heads, HEAD_DIM, generator=g) for _ in range(2))
    attention = CpuPagedAttention(kv_heads, HEAD_DIM**-0.5, load_cpu_ops().paged_attention)
    plan = attention.prepare(meta)
    times = []
    for _ in range(7):
        start = time.perf_counter()
        attention(q, k, v, k_cache, v_cache, plan)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=2)
    torch.set_num_threads(parser.parse_args().threads)
    for heads, kv_heads, cached, new in CASES:
        ms = chunk_ms(heads, kv_heads, cached, new)
        print(f"heads {heads}/{kv_heads}, {cached} cached + {new} new: {ms:.2f} ms")


if __name__ == "__main__":
    main()
