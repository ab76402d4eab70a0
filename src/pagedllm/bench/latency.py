"""`pagedllm bench latency`: time to first token and time per output token under load.

Requests arrive as a Poisson process (`--request-rate` per second, seeded). The loop
feeds LLMEngine.add_request / step on a clock of real wall time; when the engine is idle
the clock skips forward to the next arrival instead of sleeping. TTFT = first token -
arrival (queueing included); TPOT = (last token - first token) / (output tokens - 1);
normalized latency = (finish - arrival) / output tokens, the seed's metric.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from pagedllm.bench.common import (
    add_common_args,
    base_result,
    get_loaded,
    settings_from,
    workload_from,
)
from pagedllm.bench.engine_run import run_engine
from pagedllm.bench.output import add_ratios, write_outputs
from pagedllm.bench.throughput import policy_list
from pagedllm.bench.workload import with_poisson_arrivals

COLUMNS = [
    ("system", "policy"),
    ("ttft_mean_s", "TTFT mean s"),
    ("ttft_median_s", "TTFT median s"),
    ("ttft_p99_s", "TTFT p99 s"),
    ("tpot_mean_ms", "TPOT mean ms"),
    ("tpot_median_ms", "TPOT median ms"),
    ("tpot_p99_ms", "TPOT p99 ms"),
    ("norm_latency_mean_s", "norm. latency s/token"),
    ("mean_running_seqs", "mean seqs"),
    ("generated_tokens_per_s", "gen tok/s"),
    ("tpot_mean_ms_vs_reserve-max", "TPOT vs reserve-max"),
]


def add_parser(sub: Any) -> None:
    p = sub.add_parser("latency", help="TTFT and TPOT under Poisson arrivals per policy")
    add_common_args(p, num_prompts=16, out="bench-out/latency")
    p.add_argument("--request-rate", type=float, default=0.5, help="Poisson arrivals per second")
    p.add_argument("--policies", type=policy_list, default=["paged", "reserve-max"])
    p.set_defaults(func=run)


def latency_stats(per_request: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Mean / median / p99 of TTFT (s), TPOT (ms) and normalized latency (s per token)."""
    ttft, tpot, norm = [], [], []
    for r in per_request.values():
        if r["first_token"] is None or r["finish"] is None:
            continue
        ttft.append(r["first_token"] - r["arrival"])
        if r["output_len"] > 1:
            tpot.append(1000 * (r["finish"] - r["first_token"]) / (r["output_len"] - 1))
        norm.append((r["finish"] - r["arrival"]) / r["output_len"])
    out: dict[str, Any] = {}
    for name, vals in (("ttft", ttft), ("tpot", tpot), ("norm_latency", norm)):
        unit = "_ms" if name == "tpot" else "_s"
        arr = np.array(vals) if vals else None
        out[f"{name}_mean{unit}"] = round(float(arr.mean()), 4) if arr is not None else None
        out[f"{name}_median{unit}"] = round(float(np.median(arr)), 4) if arr is not None else None
        out[f"{name}_p99{unit}"] = (
            round(float(np.percentile(arr, 99)), 4) if arr is not None else None
        )
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    loaded = get_loaded(args.model)
    settings = settings_from(args, loaded)
    requests = with_poisson_arrivals(
        workload_from(args, loaded, settings.max_model_len), args.request_rate, args.seed
    )
    result = base_result("latency", args, loaded, settings, requests)
    result["config"]["request_rate"] = args.request_rate
    rows, per_policy = [], {}
    for policy in args.policies:
        run_row = run_engine(loaded, requests, settings, policy, use_arrivals=True)
        run_row.pop("timeline")
        per_request = run_row.pop("latency")
        per_policy[policy] = per_request
        rows.append({**run_row, **latency_stats(per_request)})
        print(
            f"  {policy}: TTFT mean {rows[-1]['ttft_mean_s']} s, "
            f"TPOT mean {rows[-1]['tpot_mean_ms']} ms",
            flush=True,
        )
    result["results"] = rows
    result["ratios"] = add_ratios(rows, "tpot_mean_ms", ["reserve-max"])
    for name, extra in add_ratios(rows, "ttft_mean_s", ["reserve-max"]).items():
        result["ratios"].setdefault(name, {}).update(extra)
    result["per_request"] = per_policy
    result["notes"] += [
        f"Poisson arrivals at {args.request_rate} requests/s (seed {args.seed}); the clock is "
        "real wall time, skipped forward over idle gaps",
        "TTFT includes queueing; TPOT = (finish - first token) / (output tokens - 1)",
    ]
    return write_outputs(result, args.out, COLUMNS, plots=_plots(per_policy))


def _plots(per_policy: dict[str, dict[str, dict[str, Any]]]) -> list:
    def ttft(ax: Any) -> None:
        for name, reqs in per_policy.items():
            done = [r for r in reqs.values() if r["first_token"] is not None]
            done.sort(key=lambda r: r["arrival"])
            ax.plot(
                [r["arrival"] for r in done],
                [r["first_token"] - r["arrival"] for r in done],
                marker=".",
                label=name,
            )
        ax.set_xlabel("arrival time (s)")
        ax.set_ylabel("time to first token (s)")
        ax.set_title("TTFT per request")

    def cdf(ax: Any) -> None:
        for name, reqs in per_policy.items():
            vals = sorted(
                (r["finish"] - r["arrival"]) / r["output_len"]
                for r in reqs.values()
                if r["finish"] is not None
            )
            ax.plot(vals, np.arange(1, len(vals) + 1) / max(len(vals), 1), label=name)
        ax.set_xlabel("normalized latency (s / output token)")
        ax.set_ylabel("fraction of requests")
        ax.set_title("Normalized latency CDF")

    return [("ttft", ttft), ("norm_latency_cdf", cdf)]
