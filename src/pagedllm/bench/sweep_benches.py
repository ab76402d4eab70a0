"""The benches that sweep engine options over one workload with the sweep runner: the
vLLM paper's comparison of KV reservation policies (`throughput`, `memory`, `latency`)
and its block-size trade-off (`block-size`). Every variant runs the same requests (greedy,
EOS ignored) on the same model code and scheduler, at one KV budget that leaves
`reserve-max` memory-bound.
"""

from __future__ import annotations

import argparse
from typing import Any

from pagedllm.bench import options
from pagedllm.bench.baselines import BACKENDS
from pagedllm.bench.output import Plot, add_ratios, cdf, distribution, ratio, write_outputs
from pagedllm.bench.sweep import SLOT_KINDS, SweepRun, sweep, timeline_plots
from pagedllm.bench.workload import BenchRequest
from pagedllm.core.reservation import RESERVATION_POLICIES as POLICIES
from pagedllm.loader import LoadedModel

# Prefix caching off: random prompts share nothing, so it would only blur the comparison.
ENGINE = {"enable_prefix_caching": False, "kv_cache_memory": None, "kv_reservation": None}
SAME_TOKENS = "greedy, ignore_eos, max_tokens = each request's output length: every system "
SAME_TOKENS += "generates the same tokens; prefix caching off"
COLUMNS = {
    "throughput": "system=system|requests_per_s=req/s|generated_tokens_per_s=gen tok/s|"
    "mean_running_seqs=mean seqs|peak_running_seqs=peak seqs|kv_utilization=KV util|preemptions"
    "=preempt|seconds=s|generated_tokens_per_s_vs_reserve-max=tok/s vs reserve-max|"
    "mean_running_seqs_vs_reserve-max=seqs vs reserve-max|generated_tokens_per_s_vs_hf=tok/s vs hf",
    "memory": "system=policy|peak_running_seqs=peak seqs|mean_running_seqs=mean seqs|"
    "kv_utilization=KV util|slots_tokens_frac=slots: tokens|slots_reserved_frac=slots: reserved|"
    "slots_wasted_frac=slots: wasted|max_empty_slots_per_seq=max empty/seq|kv_memory_vs_reserve_max"
    "=KV per token vs reserve-max|mean_running_seqs_vs_reserve-max=seqs vs reserve-max|"
    "preemptions=preempt|steps=steps",
    "latency": "system=policy|ttft_mean_s=TTFT mean s|ttft_median_s=TTFT median s|ttft_p99_s=TTFT "
    "p99 s|tpot_mean_ms=TPOT mean ms|tpot_median_ms=TPOT median ms|tpot_p99_ms=TPOT p99 ms|"
    "norm_latency_mean_s=norm. latency s/token|mean_running_seqs=mean seqs|generated_tokens_per_s"
    "=gen tok/s|tpot_mean_ms_vs_reserve-max=TPOT vs reserve-max",
    "block-size": "block_size=block size|generated_tokens_per_s=gen tok/s|mean_running_seqs=mean "
    "seqs|kv_utilization=KV util|internal_fragmentation=internal frag|max_empty_slots_per_seq=max "
    "empty/seq|attention_ms_per_step=attn ms/step|step_ms=step ms|attention_share=attn share|"
    "preemptions=preempt",
}


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("throughput", help="throughput per reservation policy and backend")
    options.add_bench_args(p, "throughput", throughput, {"num_prompts": 24}, ENGINE)
    p.add_argument("--policies", type=options.policies, help="comma list or 'none' (default: all)")
    p.add_argument("--backend", action="append", choices=BACKENDS, default=[], help="also run")
    p = sub.add_parser("memory", help="KV utilisation and batch size per reservation policy")
    options.add_bench_args(p, "memory", memory, {"num_prompts": 200}, ENGINE)
    p.add_argument("--policies", type=options.policies, help="comma list (default: all)")
    p.add_argument("--real", action="store_true", help="run the real model, not the fake runner")
    p = sub.add_parser("latency", help="TTFT and TPOT under Poisson arrivals per policy")
    workload = {"num_prompts": 16, "request_rate": 0.5}
    options.add_bench_args(p, "latency", latency, workload, ENGINE)
    p.add_argument("--policies", type=options.policies, help="default: paged,reserve-max")
    p = sub.add_parser("block-size", help="sweep the KV block size under paged")
    # Short, Alpaca-like requests in a small pool: the pool limits the batch, so the slots
    # that large blocks waste cost concurrency (the vLLM paper's Alpaca finding).
    workload = {"num_prompts": 32, "kind": "uniform", "kv_cache_tokens": 1024}
    workload |= {"prompt_range": (16, 64), "output_range": (16, 64)}
    engine = ENGINE | {"kv_reservation": "paged", "block_size": None, "max_model_len": 256}
    options.add_bench_args(p, "block-size", block_size, workload, engine)
    p.add_argument("--block-sizes", type=options.int_list, help="default: 1,8,16,32,64,128")


def _policies(
    name: str, args: argparse.Namespace, default: list[str], fake: bool = False
) -> tuple[LoadedModel, dict[str, Any], list[BenchRequest], dict[str, Any], list[SweepRun]]:
    """Run each policy; the model, engine options, requests, result and runs."""
    loaded, opts, requests, result = options.prepare(name, args)
    names = options.sweep_values(args, "policies", "kv_reservation", default)
    runs = sweep(args, loaded, requests, [{"kv_reservation": p} for p in names], fake)
    result["results"] = [r.row for r in runs]
    result["timelines"] = {n: r.timeline for n, r in zip(names, runs, strict=True)}
    return loaded, opts, requests, result, runs


def throughput(args: argparse.Namespace) -> dict[str, Any]:
    loaded, opts, requests, result, _ = _policies("throughput", args, list(POLICIES))
    result["notes"] += [SAME_TOKENS, "KV util, mean seqs: means over engine steps"]
    for backend in dict.fromkeys(args.backend):
        row = BACKENDS[backend](loaded, requests, opts)  # a row, or a note why it was skipped
        result["notes"].append(f"{backend}: {row.pop('note')}")
        print(f"  {result['notes'][-1]}", flush=True)
        result["results"] += [row] if "generated_tokens" in row else []
    add_ratios(result, "generated_tokens_per_s", ["reserve-max", "hf"])
    add_ratios(result, "mean_running_seqs", ["reserve-max"])
    rows = result["results"]
    tok_s = {"_": ([r["system"] for r in rows], [r["generated_tokens_per_s"] for r in rows])}
    bars = Plot("tokens_per_s", "Throughput", "", "generated tokens/s", tok_s, "bar")
    plots = [bars, *timeline_plots(result["timelines"], "seconds")]
    return write_outputs(result, args.out, COLUMNS["throughput"], plots)


def memory(args: argparse.Namespace) -> dict[str, Any]:
    *_, result, _ = _policies("memory", args, list(POLICIES), fake=not args.real)
    rows = result["results"]
    base = next((r["kv_utilization"] for r in rows if r["system"] == "reserve-max"), None)
    for r in rows:  # memory per stored token, relative: the inverse ratio of utilisations
        r["kv_memory_vs_reserve_max"] = ratio(base, r["kv_utilization"], 3)
    add_ratios(result, "mean_running_seqs", ["reserve-max"])
    result["runner"] = "real model" if args.real else "fake model runner (bookkeeping only)"
    fake = ": LLMEngine's step over FakeModelRunner (token 0); time in engine steps"
    result["notes"] += [
        f"runner: {result['runner']}{'' if args.real else fake}",
        "slots: fractions of the slots in running sequences' blocks that hold a token, are "
        "reserved for the request's later tokens, or will never be filled (wasted)",
        "KV per token vs reserve-max: reserve-max's KV util / this policy's",
        "the reservation baselines take blocks from one pool, so they have no external "
        "fragmentation here: their waste is a lower bound of a contiguous allocator's",
    ]
    names = [r["system"] for r in rows]
    stack = {kind: (names, [r[f"slots_{kind}_frac"] for r in rows]) for kind in SLOT_KINDS}
    plots = timeline_plots(result["timelines"], "seconds" if args.real else "step")
    plots.append(Plot("breakdown", "Where the KV memory goes", "", "KV slots", stack, "stack"))
    return write_outputs(result, args.out, COLUMNS["memory"], plots)


def latency_stats(per_request: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Mean / median / p99 of TTFT = first token - arrival (s), TPOT = (finish - first token)
    / (output tokens - 1) (ms), and the paper's normalized latency = (finish - arrival) /
    output tokens (s)."""
    done = [r for r in per_request.values() if r["finish"] is not None]
    ttft = [r["first_token"] - r["arrival"] for r in done]
    long = [r for r in done if r["output_len"] > 1]
    tpot = [1000 * (r["finish"] - r["first_token"]) / (r["output_len"] - 1) for r in long]
    norm = [(r["finish"] - r["arrival"]) / r["output_len"] for r in done]
    figures = distribution(ttft, "_s", "ttft_") | distribution(tpot, "_ms", "tpot_")
    return figures | distribution(norm, "_s", "norm_latency_")


def latency(args: argparse.Namespace) -> dict[str, Any]:
    *_, result, runs = _policies("latency", args, ["paged", "reserve-max"])
    result["per_request"] = {r.row["system"]: r.latency for r in runs}
    for run in runs:  # result["results"] holds these same row dicts
        run.row.update(latency_stats(run.latency))
    add_ratios(result, "tpot_mean_ms", ["reserve-max"])
    add_ratios(result, "ttft_mean_s", ["reserve-max"])
    rate = f"Poisson arrivals at {args.request_rate} requests/s (seed {args.seed}) on a wall "
    result["notes"] += [rate + "clock that skips idle gaps; TTFT includes queueing", SAME_TOKENS]
    ttft, norm = {}, {}
    for name, reqs in result["per_request"].items():
        done = sorted((r for r in reqs.values() if r["finish"]), key=lambda r: r["arrival"])
        ttft[name] = ([r["arrival"] for r in done], [r["first_token"] - r["arrival"] for r in done])
        norm[name] = cdf([(r["finish"] - r["arrival"]) / r["output_len"] for r in done])
    plots = [Plot("ttft", "TTFT per request", "arrival (s)", "time to first token (s)", ttft)]
    plots.append(Plot("norm_latency_cdf", "CDF", "s per output token", "requests", norm))
    return write_outputs(result, args.out, COLUMNS["latency"], plots)


def block_size(args: argparse.Namespace) -> dict[str, Any]:
    sizes = options.sweep_values(args, "block_sizes", "block_size", [1, 8, 16, 32, 64, 128])
    loaded, _, requests, result = options.prepare("block-size", args, block_size=sizes[0])
    for key in ("block_size", "kv_blocks", "kv_mib"):  # these vary with the block size
        del result["config"][key]
    runs = sweep(args, loaded, requests, [{"block_size": s} for s in sizes], time_attention=True)
    rows = [{"block_size": s, **r.row} for s, r in zip(sizes, runs, strict=True)]
    result["results"] = rows
    for r in rows:
        r["internal_fragmentation"] = round(1 - r["kv_utilization"], 4)
        r["attention_share"] = ratio(r["attention_ms_per_step"], r["step_ms"], 3)
    result["best_block_size"] = max(rows, key=lambda r: r["generated_tokens_per_s"])["block_size"]
    result["notes"] += [
        "same KV budget in tokens for every block size (blocks = tokens // block size)",
        "internal frag: 1 - KV util (empty slots in allocated blocks, mean over steps)",
        "attn ms/step: wall time inside the attention calls of all layers per engine step",
    ]

    def plot(name: str, ylabel: str, **lines: str) -> Plot:  # label ("_": a space): row key
        series = {k.replace("_", " "): (sizes, [r[v] for r in rows]) for k, v in lines.items()}
        return Plot(name, f"{name} by block size", "block size", ylabel, series, log2_x=True)

    plots = [
        plot("throughput", "generated tokens/s", _="generated_tokens_per_s"),
        plot("fragmentation", "empty slots / allocated", _="internal_fragmentation"),
        plot("attention", "ms per step", attention="attention_ms_per_step", whole_step="step_ms"),
    ]
    return write_outputs(result, args.out, COLUMNS["block-size"], plots)
