"""`pagedllm bench attention`: the cost of the block-table indirection.

One attention layer of the model's shape, two ways on the same inputs: the engine's
paged reference backend (write the new K/V into scattered blocks, gather the context
through the block tables, one SDPA with a position mask) against the same computation on
contiguous K/V (write into a dense [batch, kv_heads, len, head_dim] cache, then torch
SDPA). Decode (one new token per sequence) and prefill (a whole prompt), several batch
sizes and context lengths; the median of `--repeats` timed calls; the outputs agree.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F

from pagedllm.attention import ReferenceAttention, build_attention_metadata
from pagedllm.bench.common import base_result, get_loaded
from pagedllm.bench.output import write_outputs

COLUMNS = [
    ("phase", "phase"),
    ("batch", "batch"),
    ("context", "context"),
    ("paged_ms", "paged ms"),
    ("contiguous_ms", "contiguous ms"),
    ("overhead", "paged / contiguous"),
    ("max_abs_diff", "max |diff|"),
]


def ints_arg(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of ints, got {text!r}") from None


def add_parser(sub: Any) -> None:
    p = sub.add_parser("attention", help="paged attention vs the same on contiguous K/V")
    p.add_argument("--model", default=None, help="model whose attention shape to use")
    p.add_argument("--out", default="bench-out/attention")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--decode-batches", type=ints_arg, default=[1, 8, 32, 64])
    p.add_argument("--decode-contexts", type=ints_arg, default=[128, 512, 2048])
    p.add_argument("--prefill-batches", type=ints_arg, default=[1, 4])
    p.add_argument("--prefill-contexts", type=ints_arg, default=[128, 512, 1024])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def _time(fn: Any, repeats: int) -> tuple[float, Any]:
    out = fn()  # warm-up
    times = []
    for _ in range(max(repeats, 1)):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000, out


@torch.inference_mode()
def measure(
    heads: int,
    kv_heads: int,
    head_dim: int,
    batch: int,
    context: int,
    prefill: bool,
    block_size: int,
    repeats: int,
    gen: torch.Generator,
) -> dict[str, Any]:
    """One case: the paged and the contiguous timings (ms) and how far their outputs differ."""
    q_len = context if prefill else 1
    cached = context - q_len
    per_seq = -(-context // block_size)
    num_blocks = batch * per_seq + 1
    perm = torch.randperm(num_blocks, generator=gen)  # scattered blocks, as in a busy pool
    tables = [perm[i * per_seq : (i + 1) * per_seq].tolist() for i in range(batch)]

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    k_ctx, v_ctx = rnd(batch, context, kv_heads, head_dim), rnd(batch, context, kv_heads, head_dim)
    q = rnd(batch * q_len, heads, head_dim)
    k_new = k_ctx[:, cached:].reshape(-1, kv_heads, head_dim).contiguous()
    v_new = v_ctx[:, cached:].reshape(-1, kv_heads, head_dim).contiguous()

    k_cache = torch.zeros(num_blocks, block_size, kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    pos = torch.arange(cached)  # the cached part of each context goes into its blocks
    slots = (torch.tensor(tables)[:, pos // block_size] * block_size + pos % block_size).flatten()
    k_cache.view(-1, kv_heads, head_dim)[slots] = k_ctx[:, :cached].reshape(-1, kv_heads, head_dim)
    v_cache.view(-1, kv_heads, head_dim)[slots] = v_ctx[:, :cached].reshape(-1, kv_heads, head_dim)
    meta = build_attention_metadata(
        [cached] * batch, [q_len] * batch, tables, list(range(batch)), block_size
    )
    scale = head_dim**-0.5
    paged = ReferenceAttention(heads, kv_heads, head_dim, scale)
    paged_ms, paged_out = _time(lambda: paged(q, k_new, v_new, k_cache, v_cache, meta), repeats)

    k_dense = torch.zeros(batch, kv_heads, context, head_dim)
    v_dense = torch.zeros_like(k_dense)
    k_dense[:, :, :cached] = k_ctx[:, :cached].transpose(1, 2)
    v_dense[:, :, :cached] = v_ctx[:, :cached].transpose(1, 2)
    kn = k_new.view(batch, q_len, kv_heads, head_dim).transpose(1, 2)
    vn = v_new.view(batch, q_len, kv_heads, head_dim).transpose(1, 2)
    qd = q.view(batch, q_len, heads, head_dim).transpose(1, 2)

    def contiguous() -> torch.Tensor:
        k_dense[:, :, cached:context] = kn
        v_dense[:, :, cached:context] = vn
        o = F.scaled_dot_product_attention(
            qd, k_dense, v_dense, is_causal=prefill, scale=scale, enable_gqa=True
        )
        return o.transpose(1, 2).reshape(batch * q_len, heads, head_dim)

    dense_ms, dense_out = _time(contiguous, repeats)
    return {
        "phase": "prefill" if prefill else "decode",
        "batch": batch,
        "context": context,
        "paged_ms": round(paged_ms, 3),
        "contiguous_ms": round(dense_ms, 3),
        "overhead": round(paged_ms / dense_ms, 2) if dense_ms else None,
        "max_abs_diff": float((paged_out - dense_out).abs().max()),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    loaded = get_loaded(args.model)
    cfg = loaded.config
    result = base_result("attention", args, loaded, None, None)
    limit = cfg.max_position_embeddings
    result["config"].update(
        heads=cfg.num_attention_heads,
        kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        block_size=args.block_size,
        repeats=args.repeats,
        threads=torch.get_num_threads(),
    )
    gen = torch.Generator().manual_seed(args.seed)
    cases = [(b, c, False) for b in args.decode_batches for c in args.decode_contexts]
    cases += [(b, c, True) for b in args.prefill_batches for c in args.prefill_contexts]
    rows = []
    for batch, context, prefill in cases:
        if context > limit:
            continue
        rows.append(
            measure(
                cfg.num_attention_heads,
                cfg.num_key_value_heads,
                cfg.head_dim,
                batch,
                context,
                prefill,
                args.block_size,
                args.repeats,
                gen,
            )
        )
    result["results"] = rows
    ratios = [r["overhead"] for r in rows if r["overhead"]]
    result["ratios"] = {
        "median_overhead": round(statistics.median(ratios), 2) if ratios else None,
        "decode_median_overhead": _median([r for r in rows if r["phase"] == "decode"]),
        "prefill_median_overhead": _median([r for r in rows if r["phase"] == "prefill"]),
    }
    result["notes"] += [
        "one attention layer (the model's heads, KV heads, head dim), fp32, CPU; ms per call",
        "paged: the engine's ReferenceAttention (index_copy into blocks, gather through the "
        "block table, SDPA with a position mask); contiguous: slice write + SDPA on dense K/V",
    ]
    return write_outputs(result, args.out, COLUMNS, plots=_plots(rows))


def _median(rows: list[dict[str, Any]]) -> float | None:
    vals = [r["overhead"] for r in rows if r["overhead"]]
    return round(statistics.median(vals), 2) if vals else None


def _plots(rows: list[dict[str, Any]]) -> list:
    def draw(ax: Any) -> None:
        labels = [f"{r['phase'][0]} b{r['batch']} c{r['context']}" for r in rows]
        ax.bar(labels, [r["overhead"] for r in rows], color="tab:orange")
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_ylabel("paged ms / contiguous ms")
        ax.set_title("Cost of the block-table indirection (d=decode, p=prefill)")
        ax.tick_params(axis="x", labelrotation=70, labelsize=7)

    return [("overhead", draw)]
