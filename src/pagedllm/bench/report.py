"""`pagedllm bench report`: run the standard suite and write docs/benchmarks.md.

The suite's benches run in this one process on one loaded model (about 10 minutes on 2
CPU cores), each writing its files under `--out/<bench>`. The page sets each of the vLLM
paper's claims beside what we measured, our goal, the verdict and the command. Whatever
an existing page holds from the `KEPT` line on (benches measured apart from the suite,
such as `bench scale-out`) is carried over to the new page unchanged.
"""

from __future__ import annotations

import argparse
import operator
import os
import shlex
import string
import time
from typing import Any

from pagedllm.bench import engine_benches, sweep_benches
from pagedllm.bench.output import fmt, markdown_body, markdown_table

KEPT = "<!-- Measured apart from the suite: `pagedllm bench report` keeps what follows. -->"

# bench: its options, and the ones that shrink it with --quick. reserve-pow2 runs in
# `memory` only: its model run would push the suite past 10 minutes.
_TINY = "--workload fixed --prompt-len 8 --output-len 4"
SUITE = {
    "memory": ("", "--num-prompts 12"),
    "throughput": (
        "--policies paged,reserve-max,reserve-oracle --backend hf --backend llama-cpp",
        f"--num-prompts 3 {_TINY}",
    ),
    "latency": ("--num-prompts 10", f"--num-prompts 3 --request-rate 20 {_TINY}"),
    "block-size": ("", f"--num-prompts 2 --block-sizes 8,16 {_TINY}"),
    "attention": (
        "--repeats 5",
        "--decode-batches 1,2 --decode-contexts 16,32 --prefill-batches 1 "
        "--prefill-contexts 16 --repeats 1",
    ),
}
RESERVE = ("reserve-max", "reserve-pow2", "reserve-oracle")
OPS = {">=": operator.ge, "<=": operator.le, "<": operator.lt}
# Per claim three lines: "claim | what the vLLM paper says | our goal | bench", what we
# measured, and the check of our goal ("-": none). Figures: `bench.system.key` (a row's),
# `bench.system/base.key` (a ratio of rows'), `bench.vs.key` (paged's ratio to each policy
# run), `bench.each.key` (every row's), `bench.part.key` or `bench.key` (a result field);
# `:pct`, `:less` (1 - it, as a percentage) and `:x` format fractions and ratios.
CLAIMS = """
KV slots holding tokens, paged | near-zero waste (< 4%) | >= 96% | throughput
{throughput.paged.kv_utilization:pct} (model run); {memory.paged.kv_utilization:pct} (bookkeeping)
throughput.paged.kv_utilization >= 0.96
KV slots holding tokens, reserve-max | 20.4-38.2% in prior systems | <= 40% | throughput
{throughput.reserve-max.kv_utilization:pct} (model run); {memory.reserve-max.kv_utilization:pct} (bookkeeping)
throughput.reserve-max.kv_utilization <= 0.40
KV memory for the same tokens | 55% less | >= 55% less vs reserve-max | throughput
{throughput.reserve-max/paged.kv_utilization:less} less than reserve-max, {throughput.reserve-oracle/paged.kv_utilization:less} less than reserve-oracle
throughput.reserve-max/paged.kv_utilization <= 0.45
Batch size (mean concurrent sequences) | 2-3x larger | >= 2x reserve-max | throughput
model run: {throughput.vs.mean_running_seqs}; bookkeeping run: {memory.vs.mean_running_seqs}
throughput.paged/reserve-max.mean_running_seqs >= 2
Throughput vs contiguous reservation | 2-4x vs FasterTransformer, Orca | >= 2x reserve-max | throughput
{throughput.vs.generated_tokens_per_s} ({throughput.paged.generated_tokens_per_s} vs {throughput.reserve-max.generated_tokens_per_s} tok/s)
throughput.paged/reserve-max.generated_tokens_per_s >= 2
Throughput vs Hugging Face transformers | up to 24x (vLLM blog, GPU) | >= 5x | throughput
{throughput.paged/hf.generated_tokens_per_s:x} ({throughput.paged.generated_tokens_per_s} vs {throughput.hf.generated_tokens_per_s} tok/s)
throughput.paged/hf.generated_tokens_per_s >= 5
Latency at the same load | similar latency, higher sustainable rate | - | latency
TPOT {latency.paged.tpot_mean_ms} vs {latency.reserve-max.tpot_mean_ms} ms ({latency.paged/reserve-max.tpot_mean_ms:x}); TTFT {latency.paged.ttft_mean_s} vs {latency.reserve-max.ttft_mean_s} s ({latency.paged/reserve-max.ttft_mean_s:x})
-
Internal fragmentation | at most one block per sequence | < block size | memory
max {memory.paged.max_empty_slots_per_seq} (bookkeeping), {throughput.paged.max_empty_slots_per_seq} (model run) empty slots per sequence; block size {memory.config.block_size}
memory.paged.max_empty_slots_per_seq < memory.config.block_size
External fragmentation | none | none by construction | memory
every block the same size; paged filled {memory.paged.peak_used_blocks} of {memory.config.kv_blocks} blocks at its peak
memory.paged.peak_used_blocks <= memory.config.kv_blocks
Cost of the block-table indirection | 20-26% slower kernel (GPU) | - | attention
paged / contiguous attention: decode {attention.ratios.decode_median_overhead:x}, prefill {attention.ratios.prefill_median_overhead:x} (median over shapes, CPU)
-
Block size | 16-64 the usual sweet spot | - | block-size
best {block-size.best_block_size}; tok/s by size: {block-size.each.generated_tokens_per_s}
-
"""  # noqa: E501 (one line per template reads as a table)
COLUMNS = "claim=claim|paper=the vLLM paper says|measured=measured here|target=our goal|"
COLUMNS += "verdict=verdict|command=command"
PAGE = """\
# Benchmarks: the vLLM paper's performance table, measured

Written by `pagedllm bench report{quick}` on {time} in {seconds}. Model: {model}; {cpus}
CPUs, torch {torch} with {torch_threads} threads, fp32, OMP_WAIT_POLICY {omp_wait_policy}
(PASSIVE keeps torch from slowing 4x when other processes share the cores). Load average
{load_average_1m_at_start} at the start, {load_end:.2f} at the end: absolute figures are
noisy (about +-20%); ratios are measured side by side.

The paper measured on GPUs against FasterTransformer and Orca; here the systems it
replaced are reservation policies of this engine, on the same model code and scheduler:
`reserve-max` reserves max_model_len tokens per request (FasterTransformer, Orca-Max),
`reserve-pow2` the final length rounded up to a power of two, `reserve-oracle` exactly
the final length; plus transformers `generate` in static batches, packed knowing every
output length (which favours it). The KV budget ({kv_tokens} tokens, with max_model_len
{max_model_len}) keeps them memory-bound; our goals are for the ShareGPT-shaped workload
at that budget. On CPU cores the model is compute-bound from a small batch on, so a larger
batch buys less throughput than on a GPU. The reservation policies take blocks from one
pool, so their waste here is a lower bound of a contiguous allocator's. The attention
comparison times the engine's `{attention_backend}` backend (reading K/V through the
block tables) against torch SDPA on contiguous K/V, not the paper's CUDA kernel.

{claims}

Each bench's full table follows; its JSON, Markdown and plots are under `{out}/<bench>/`.
"""


def add_parser(sub: Any) -> None:
    p = sub.add_parser("report", help="run the standard suite; write docs/benchmarks.md")
    p.add_argument(
        "--model", help="a .gguf file, HF directory or packaged model name (default: SmolLM2)"
    )
    p.add_argument("--out", default="bench-out/report", help="folder for each bench's files")
    p.add_argument("--docs", default="docs/benchmarks.md", help="the page to write")
    p.add_argument("--quick", action="store_true", help="tiny workloads (for tests)")
    p.add_argument("--skip", default="", help="comma list of benches to leave out")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> dict[str, Any]:
    # The suite's own parser: the report depends on the benches it runs, never on cli.py.
    parser = argparse.ArgumentParser(prog="pagedllm bench")
    sub = parser.add_subparsers(dest="bench_command", required=True)
    sweep_benches.add_parsers(sub)
    engine_benches.add_parsers(sub)
    results: dict[str, dict[str, Any]] = {}
    seconds: dict[str, float] = {}
    for name, (options, quick) in SUITE.items():
        if name in args.skip.split(","):
            continue
        argv = ["bench", name, *shlex.split(options), "--out", os.path.join(args.out, name)]
        argv += shlex.split(quick if args.quick else "")
        argv += ["--model", args.model] if args.model else []
        print(f"== pagedllm {shlex.join(argv)}", flush=True)
        start = time.perf_counter()
        bench_args = parser.parse_args(argv[1:])
        results[name] = bench_args.func(argparse.Namespace(**vars(bench_args), argv=argv))
        seconds[name] = round(time.perf_counter() - start, 1)
    claims = claims_rows(results)
    first = next(iter(results.values()))
    per_bench = ", ".join(f"{name} {s:.0f} s" for name, s in seconds.items())
    took = f"{sum(seconds.values()):.0f} s ({per_bench})"
    config = first["config"]
    page = PAGE.format(
        quick=" --quick" * args.quick,
        kv_tokens=config.get("kv_tokens", "-"),
        max_model_len=config.get("max_model_len", "-"),
        attention_backend=results.get("attention", {})
        .get("config", {})
        .get("attention_backend", "-"),
        seconds=took,
        model=config["model"],
        load_end=os.getloadavg()[0],
        claims=markdown_table(claims, COLUMNS),
        out=args.out,
        **first["environment"],
    )
    for name, result in results.items():
        page += "\n".join(["", f"## {name}", "", *markdown_body(result), ""])
    os.makedirs(os.path.dirname(os.path.abspath(args.docs)), exist_ok=True)
    page = with_kept_sections(page, args.docs)
    with open(args.docs, "w", encoding="utf-8") as f:
        f.write(page)
    print("\n" + markdown_table(claims, COLUMNS.rsplit("|", 1)[0]))
    print(f"\nwrote {args.docs}; suite took {took}")
    return {"bench": "report", "claims": claims, "seconds": seconds, "results": results}


def with_kept_sections(page: str, path: str) -> str:
    """`page`, then what the page at `path` holds from its KEPT line on (if anything)."""
    try:
        with open(path, encoding="utf-8") as f:
            old = f.read()
    except FileNotFoundError:
        return page
    at = old.find(KEPT)
    return page if at < 0 else page.rstrip("\n") + "\n\n" + old[at:]


def claims_rows(results: dict[str, dict[str, Any]]) -> list[dict[str, str]]:
    """One row per claim; a bench missing from `results` gives "-" rather than an error."""
    figures, lines, rows = Figures(results), CLAIMS.strip().splitlines(), []
    for head, template, check in zip(lines[::3], lines[1::3], lines[2::3], strict=True):
        claim, paper, target, bench = head.split(" | ")
        command = results.get(bench, {}).get("command")
        rows.append(
            {"claim": claim, "paper": paper, "measured": figures.format(template)}
            | {"target": target, "verdict": figures.verdict(check)}
            | {"command": f"`{command}`" if command else "-"}
        )
    return rows


class Figures(string.Formatter):
    """Formats CLAIMS' templates, and checks their goals, over the suite's results."""

    def __init__(self, results: dict[str, dict[str, Any]]) -> None:
        self.results = results

    def figure(self, path: str) -> Any:
        """The figure at `path` (see CLAIMS), None where the results lack it."""
        bench, *parts = path.split(".")
        result = self.results.get(bench, {})
        if len(parts) == 1:
            return result.get(parts[0])
        (what, key), rows = parts, result.get("results", [])
        by_system = {r.get("system"): r.get(key) for r in rows}
        if what == "each":  # named by the rows' first column
            return ", ".join(f"{next(iter(r.values()))}: {fmt(r[key])}" for r in rows) or None
        if what == "vs":
            ratios = {p: self.figure(f"{bench}.paged/{p}.{key}") for p in RESERVE}
            return ", ".join(f"{x:.2f}x {p}" for p, x in ratios.items() if x is not None) or None
        if "/" in what:
            a, b = (by_system.get(system) for system in what.split("/"))
            return a / b if a is not None and b else None
        return by_system[what] if what in by_system else result.get(what, {}).get(key)

    def get_field(self, field_name: str, args: Any, kwargs: Any) -> tuple[Any, str]:
        return self.figure(field_name), field_name

    def format_field(self, value: Any, spec: str) -> str:
        if value is None:
            return "-"
        value, spec = (1 - value, "pct") if spec == "less" else (value, spec)
        styles = {"pct": "{:.1%}", "x": "{:.2f}x"}
        return styles[spec].format(value) if spec in styles else fmt(value)

    def verdict(self, check: str) -> str:
        if check == "-":
            return "-"
        left, op, right = check.split()
        a = self.figure(left)
        b = float(right) if right[0].isdigit() else self.figure(right)
        return "-" if a is None or b is None else "met" if OPS[op](a, b) else "missed"
