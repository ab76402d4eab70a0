"""`pagedllm bench block-size`: the block-size trade-off under `paged`.

For each block size, the same workload at the same KV budget in tokens: throughput,
internal fragmentation (empty slots in allocated blocks), and the attention time per
engine step (each decoder layer's attention call timed from outside the engine). Small
blocks cost more block-table indirection; large ones waste more slots and so fit fewer
sequences. The seed finds 16-64 the usual sweet spot. Defaults: 32 short requests
(uniform 16-64 prompt and output tokens), a 1024-token pool, max_model_len 256.
"""

from __future__ import annotations

import argparse
from typing import Any

from pagedllm.bench.common import (
    add_common_args,
    base_result,
    get_loaded,
    settings_from,
    workload_from,
)
from pagedllm.bench.engine_run import run_engine
from pagedllm.bench.output import write_outputs

DEFAULT_SIZES = (1, 8, 16, 32, 64, 128)
COLUMNS = [
    ("block_size", "block size"),
    ("generated_tokens_per_s", "gen tok/s"),
    ("mean_running_seqs", "mean seqs"),
    ("kv_utilization", "KV util"),
    ("internal_fragmentation", "internal frag"),
    ("max_empty_slots_per_seq", "max empty/seq"),
    ("attention_ms_per_step", "attn ms/step"),
    ("step_ms", "step ms"),
    ("attention_share", "attn share"),
    ("preemptions", "preempt"),
]


def sizes_arg(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of ints, got {text!r}") from None
    if not sizes or any(not 1 <= s <= 256 for s in sizes):
        raise argparse.ArgumentTypeError("block sizes must be in [1, 256]")
    return sizes


def add_parser(sub: Any) -> None:
    p = sub.add_parser("block-size", help="sweep the KV block size under paged")
    add_common_args(p, num_prompts=32, out="bench-out/block-size")
    p.add_argument("--block-sizes", type=sizes_arg, default=list(DEFAULT_SIZES))
    # Short, Alpaca-like requests in a small pool: the pool limits the batch, so the
    # slots that large blocks waste cost concurrency (the seed's Alpaca finding).
    p.set_defaults(
        workload="uniform",
        prompt_range=(16, 64),
        output_range=(16, 64),
        kv_cache_tokens=1024,
        max_model_len=256,
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> dict[str, Any]:
    loaded = get_loaded(args.model)
    first = settings_from(args, loaded, block_size=args.block_sizes[0])
    requests = workload_from(args, loaded, first.max_model_len)
    result = base_result("block-size", args, loaded, None, requests)
    result["config"].update(max_model_len=first.max_model_len, policy="paged")
    rows = []
    for bs in args.block_sizes:
        settings = settings_from(args, loaded, block_size=bs)
        row = run_engine(loaded, requests, settings, "paged", time_attention=True)
        row.pop("timeline")
        row.pop("latency")
        row["block_size"] = bs
        row["kv_tokens"] = settings.kv_tokens
        util = row.get("kv_utilization")
        row["internal_fragmentation"] = round(1 - util, 4) if util is not None else None
        attn, step = row.get("attention_ms_per_step"), row.get("step_ms")
        row["attention_share"] = round(attn / step, 3) if attn and step else None
        rows.append(row)
        print(f"  block size {bs}: {row['generated_tokens_per_s']} generated tokens/s", flush=True)
    result["results"] = rows
    result["config"]["kv_tokens"] = rows[0]["kv_tokens"]
    best = max(rows, key=lambda r: r["generated_tokens_per_s"] or 0)
    result["best_block_size"] = best["block_size"]
    result["notes"] += [
        "same KV budget in tokens for every block size (blocks = tokens // block size)",
        "internal frag: 1 - KV util (empty slots in allocated blocks, mean over steps)",
        "attn ms/step: wall time inside the attention calls of all layers per engine step "
        "(K/V write, block-table gather and SDPA)",
    ]
    return write_outputs(result, args.out, COLUMNS, plots=_plots(rows))


def _plots(rows: list[dict[str, Any]]) -> list:
    sizes = [r["block_size"] for r in rows]

    def tput(ax: Any) -> None:
        ax.plot(sizes, [r["generated_tokens_per_s"] for r in rows], marker="o")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("block size (tokens)")
        ax.set_ylabel("generated tokens/s")
        ax.set_title("Throughput vs block size")

    def frag(ax: Any) -> None:
        ax.plot(sizes, [r["internal_fragmentation"] for r in rows], marker="o", label="frag")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("block size (tokens)")
        ax.set_ylabel("empty slots / allocated slots")
        ax.set_title("Internal fragmentation vs block size")

    def attn(ax: Any) -> None:
        ax.plot(
            sizes, [r.get("attention_ms_per_step") for r in rows], marker="o", label="attention"
        )
        ax.plot(sizes, [r.get("step_ms") for r in rows], marker="o", label="whole step")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("block size (tokens)")
        ax.set_ylabel("ms per engine step")
        ax.set_title("Attention time per step vs block size")

    return [("throughput", tput), ("fragmentation", frag), ("attention", attn)]
