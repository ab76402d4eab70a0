"""`pagedllm bench memory`: at a fixed KV budget, how many requests fit at once and what
fraction of the reserved KV slots holds real tokens, per reservation policy.

These are the seed's "memory waste" and "batch size" rows. By default the run uses the
real Scheduler and KVCacheManager with a fake model runner (bench/simulate.py): it is
about bookkeeping, and exact in block counts; time is counted in steps. `--real` runs the
real model instead (slow on a CPU).
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
from pagedllm.bench.output import add_ratios, write_outputs
from pagedllm.bench.simulate import simulate
from pagedllm.bench.throughput import policy_list
from pagedllm.core.reservation import RESERVATION_POLICIES as KV_RESERVATIONS

COLUMNS = [
    ("system", "policy"),
    ("peak_running_seqs", "peak seqs"),
    ("mean_running_seqs", "mean seqs"),
    ("kv_utilization", "KV util"),
    ("slots_tokens_frac", "slots: tokens"),
    ("slots_reserved_frac", "slots: reserved"),
    ("slots_wasted_frac", "slots: wasted"),
    ("max_empty_slots_per_seq", "max empty/seq"),
    ("kv_memory_vs_reserve_max", "KV per token vs reserve-max"),
    ("mean_running_seqs_vs_reserve-max", "seqs vs reserve-max"),
    ("preemptions", "preempt"),
    ("steps", "steps"),
]


def add_parser(sub: Any) -> None:
    p = sub.add_parser("memory", help="KV utilisation and batch size per reservation policy")
    add_common_args(p, num_prompts=200, out="bench-out/memory")
    p.add_argument("--policies", type=policy_list, default=list(KV_RESERVATIONS))
    p.add_argument(
        "--real", action="store_true", help="run the real model instead of the fake runner (slow)"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> dict[str, Any]:
    loaded = get_loaded(args.model)
    settings = settings_from(args, loaded)
    requests = workload_from(args, loaded, settings.max_model_len)
    result = base_result("memory", args, loaded, settings, requests)
    rows: list[dict[str, Any]] = []
    timelines: dict[str, dict[str, list[Any]]] = {}
    for policy in args.policies:
        if args.real:
            from pagedllm.bench.engine_run import run_engine

            row = run_engine(loaded, requests, settings, policy)
            row.pop("latency")
        else:
            row = simulate(requests, settings, policy)
        timelines[policy] = row.pop("timeline")
        rows.append(row)
    base = next((r for r in rows if r["system"] == "reserve-max"), None)
    for r in rows:
        util, base_util = r.get("kv_utilization"), base and base.get("kv_utilization")
        r["kv_memory_vs_reserve_max"] = round(base_util / util, 3) if base_util and util else None
    result["results"] = rows
    result["ratios"] = add_ratios(rows, "mean_running_seqs", ["reserve-max"])
    result["timelines"] = timelines
    result["runner"] = "real model" if args.real else "fake model runner (bookkeeping only)"
    result["notes"] += [
        "runner: "
        + result["runner"]
        + (
            ""
            if args.real
            else ": the real Scheduler and KVCacheManager, a fake model that returns token 0; "
            "time axis in steps"
        ),
        "slots: fractions of the slots in running sequences' blocks that hold a token, are "
        "reserved for this request's later tokens, or will never be filled (wasted)",
        "KV per token vs reserve-max: memory this policy needs per stored token, as a "
        "fraction of what reserve-max needs (reserve-max util / this util)",
        "the reservation baselines take blocks from one pool, so they have no external "
        "fragmentation here: their waste is a lower bound of a contiguous allocator's",
    ]
    unit = "seconds" if args.real else "step"
    return write_outputs(result, args.out, COLUMNS, plots=_plots(rows, timelines, unit))


def _plots(
    rows: list[dict[str, Any]], timelines: dict[str, dict[str, list[Any]]], unit: str
) -> list:
    def util(ax: Any) -> None:
        for name, tl in timelines.items():
            ax.plot(tl["t"], tl["utilization"], label=name)
        ax.set_xlabel(unit)
        ax.set_ylabel("tokens stored / slots allocated")
        ax.set_ylim(0, 1.05)
        ax.set_title("KV utilisation over time")

    def running(ax: Any) -> None:
        for name, tl in timelines.items():
            ax.plot(tl["t"], tl["running"], label=name)
        ax.set_xlabel(unit)
        ax.set_ylabel("running sequences")
        ax.set_title("Requests in the batch")

    def breakdown(ax: Any) -> None:
        names = [r["system"] for r in rows]
        bottom = [0.0] * len(rows)
        for key, label in (
            ("slots_tokens_frac", "tokens"),
            ("slots_reserved_frac", "reserved"),
            ("slots_wasted_frac", "wasted"),
        ):
            vals = [r.get(key) or 0.0 for r in rows]
            ax.bar(names, vals, bottom=bottom, label=label)
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        ax.set_ylabel("fraction of allocated KV slots")
        ax.set_title("Where the KV memory goes")

    return [("utilization", util), ("running", running), ("breakdown", breakdown)]
