"""`pagedllm bench throughput`: offline throughput at a fixed KV memory budget.

Every reservation policy runs the same requests on the same model code and scheduler;
`--backend hf` adds transformers `generate` in static batches sized to the same budget,
and `--backend llama-cpp` llama.cpp where it is installed. Ratios are printed against
`reserve-max` and `hf`.
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
from pagedllm.bench.hf_backend import run_hf
from pagedllm.bench.llamacpp_backend import run_llama_cpp
from pagedllm.bench.output import add_ratios, write_outputs
from pagedllm.core.reservation import RESERVATION_POLICIES as KV_RESERVATIONS

BACKENDS = ("hf", "llama-cpp")
COLUMNS = [
    ("system", "system"),
    ("requests_per_s", "req/s"),
    ("generated_tokens_per_s", "gen tok/s"),
    ("mean_running_seqs", "mean seqs"),
    ("peak_running_seqs", "peak seqs"),
    ("kv_utilization", "KV util"),
    ("preemptions", "preempt"),
    ("seconds", "s"),
    ("generated_tokens_per_s_vs_reserve-max", "tok/s vs reserve-max"),
    ("mean_running_seqs_vs_reserve-max", "seqs vs reserve-max"),
    ("generated_tokens_per_s_vs_hf", "tok/s vs hf"),
]


def policy_list(text: str) -> list[str]:
    if text.strip() == "none":
        return []
    names = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in names if p not in KV_RESERVATIONS]
    if bad:
        raise argparse.ArgumentTypeError(
            f"policies must be 'none' or a comma list of {', '.join(KV_RESERVATIONS)}"
        )
    return names


def add_parser(sub: Any) -> None:
    p = sub.add_parser("throughput", help="offline throughput per reservation policy and backend")
    add_common_args(p, num_prompts=24, out="bench-out/throughput")
    p.add_argument(
        "--policies",
        type=policy_list,
        default=list(KV_RESERVATIONS),
        help="comma list of reservation policies, or 'none'",
    )
    p.add_argument(
        "--backend",
        action="append",
        choices=BACKENDS,
        default=[],
        help="also run an external baseline (repeatable)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> dict[str, Any]:
    loaded = get_loaded(args.model)
    settings = settings_from(args, loaded)
    requests = workload_from(args, loaded, settings.max_model_len)
    result = base_result("throughput", args, loaded, settings, requests)
    rows: list[dict[str, Any]] = []
    timelines: dict[str, dict[str, list[Any]]] = {}
    for policy in args.policies:
        row = run_engine(loaded, requests, settings, policy)
        timelines[policy] = row.pop("timeline")
        row.pop("latency")
        rows.append(row)
        print(f"  {policy}: {row['generated_tokens_per_s']} generated tokens/s", flush=True)
    for backend in dict.fromkeys(args.backend):
        if backend == "hf":
            row = run_hf(loaded, requests, settings.kv_tokens, settings.max_num_seqs)
        else:
            row = run_llama_cpp(loaded, requests, settings.max_model_len)
        if "skipped" in row:
            print(f"  {backend}: {row['skipped']}", flush=True)
            result["notes"].append(f"{backend}: {row['skipped']}")
            continue
        rows.append(row)
        print(f"  {backend}: {row['generated_tokens_per_s']} generated tokens/s", flush=True)
    result["results"] = rows
    result["ratios"] = add_ratios(rows, "generated_tokens_per_s", ["reserve-max", "hf"])
    for name, extra in add_ratios(rows, "mean_running_seqs", ["reserve-max"]).items():
        result["ratios"].setdefault(name, {}).update(extra)
    result["timelines"] = timelines
    result["notes"] += [
        "greedy, ignore_eos, max_tokens = each request's output length: every system "
        "generates the same tokens; prefix caching off (random prompts share nothing)",
        "KV util: tokens stored / slots in allocated blocks, mean over steps; mean seqs: "
        "running sequences, mean over steps",
    ]
    if any(r["system"] == "hf" for r in rows):
        result["notes"].append(
            "hf: transformers generate in static left-padded batches packed to fit the same "
            "KV token budget knowing every output length; its KV util counts padding slots"
        )
    return write_outputs(result, args.out, COLUMNS, plots=_plots(rows, timelines))


def _plots(rows: list[dict[str, Any]], timelines: dict[str, dict[str, list[Any]]]) -> list:
    def bars(ax: Any) -> None:
        names = [r["system"] for r in rows]
        ax.bar(names, [r["generated_tokens_per_s"] for r in rows], color="tab:blue")
        ax.set_ylabel("generated tokens/s")
        ax.set_title("Offline throughput at a fixed KV budget")

    def util(ax: Any) -> None:
        for name, tl in timelines.items():
            ax.plot(tl["t"], tl["utilization"], label=name)
        ax.set_xlabel("seconds")
        ax.set_ylabel("KV utilisation")
        ax.set_ylim(0, 1.05)
        ax.set_title("Tokens stored / slots allocated")

    def running(ax: Any) -> None:
        for name, tl in timelines.items():
            ax.plot(tl["t"], tl["running"], label=name)
        ax.set_xlabel("seconds")
        ax.set_ylabel("running sequences")
        ax.set_title("Concurrent sequences")

    return [("tokens_per_s", bars), ("utilization", util), ("running", running)]
