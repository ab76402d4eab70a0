"""`pagedllm bench llamacpp`: pagedllm's `--quantization gguf` against llama.cpp on the same
GGUF files, one stream, the same threads.

Models: `smollm2-135m`, the packaged SmolLM2-135M-Instruct Q4_1 file as is; `smollm2-1.7b`
and `qwen2.5-7b`, real-shaped models of random weights (bench/random_gguf.py) written as
F16 and quantized by llama.cpp's `llama-quantize` to Q4_K_M (`--quant`: another type the
kernels compute on). Those files are kept in `--work` and reused by a later run of the same
shape, seed and type; the F16 is deleted once quantized unless `--keep-f16`. llama.cpp
decodes with `llama-bench -p 0 -n STEPS -o json` (its tg figure) and, with
`--prompt-tokens N` (default 512), processes a prompt in the same call (`-p N`, its ppN
figure); pagedllm in bench/gguf_probe.py. Each runs in a process of
its own, whose peak resident memory `wait4` reports; the two alternate for `--rounds`
rounds, so that a machine whose speed drifts sways both alike (the ratio is the median of
the rounds').
Without llama.cpp the bench says so and measures pagedllm alone (on a shaped model only
where its quantized file is already in `--work`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
from pathlib import Path
from typing import Any

from pagedllm.bench import options
from pagedllm.bench.gguf_probe import PROMPT_LEN, PROMPT_REPETITIONS, probe_pagedllm
from pagedllm.bench.measured_process import run_measured
from pagedllm.bench.memory_floor import read_bytes_per_second
from pagedllm.bench.output import ratio, write_outputs
from pagedllm.bench.random_gguf import SHAPES, ModelShape, write_random_gguf
from pagedllm.errors import InvalidParameterError, KernelUnavailableError
from pagedllm.loader import default_model_path

PACKAGED = "smollm2-135m"
MODELS = (PACKAGED, *SHAPES)
QUANT = "Q4_K_M"
# llama-quantize's names of the files whose every tensor the GGUF kernels compute on
QUANTS = (QUANT, "Q5_K_M", "Q4_0", "Q4_1", "Q5_0", "Q8_0")
TOOLS = ("llama-bench", "llama-quantize")
BIN_ENV = "PAGEDLLM_LLAMA_CPP_BIN"
HEADROOM = 0.5e9  # the memory bound: file + KV pool + this
GB = 1e9
TIMEOUT_S = 3600
COLUMNS = "|".join(
    [
        "model=model",
        "file_gb=file GB",
        "llama_cpp_ms=llama.cpp ms/token",
        "pagedllm_ms=pagedllm ms/token",
        "ms_ratio=pagedllm / llama.cpp",
        "floor_ms=weights-read floor ms",
        "llama_cpp_rss_gb=llama.cpp peak RSS GB",
        "pagedllm_rss_gb=pagedllm peak RSS GB",
        "rss_ratio=pagedllm / llama.cpp",
        "bound_gb=bound GB (file + KV + 0.5)",
        "within_bound=within bound",
        "ready_s=ready to serve s",
        "process_ready_s=from process start s",
    ]
)
PROMPT_COLUMNS = "|".join(
    [
        "llama_cpp_prompt_tok_s=llama.cpp prompt tok/s",
        "pagedllm_prompt_tok_s=pagedllm prompt tok/s",
        "prompt_ratio=prompt: pagedllm / llama.cpp",
    ]
)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "llamacpp", help="--quantization gguf against llama.cpp on the same GGUF files"
    )
    options.add_bench_args(p, "llamacpp", run)
    models = options.choice_list(MODELS, "model")
    p.add_argument("--models", type=models, default=",".join(MODELS), help="default: %(default)s")
    where = f"folder holding {' and '.join(TOOLS)} (default: ${BIN_ENV}, else the PATH)"
    p.add_argument("--llama-cpp-bin", help=where)
    work = "folder for the written GGUF files, reused by later runs (default: %(default)s)"
    p.add_argument("--work", default="bench-work/llamacpp", help=work)
    p.add_argument("--steps", type=int, default=32, help="decode steps timed (default: 32)")
    prompt = "prompt processed in one step, as llama-bench's ppN (default: 512; 0: not timed)"
    p.add_argument("--prompt-tokens", type=int, default=512, help=prompt)
    rounds = "llama.cpp then pagedllm, this many times per model (default: %(default)s)"
    p.add_argument("--rounds", type=int, default=3, help=rounds)
    p.add_argument("--threads", type=int, default=2, help="both systems' threads (default: 2)")
    kv = "pagedllm's KV pool (default: %(default)s)"
    p.add_argument("--kv-cache-memory", default="256MiB", help=kv)
    quant = "llama-quantize's type for the shaped models (default: %(default)s)"
    p.add_argument("--quant", choices=QUANTS, default=QUANT, help=quant)
    p.add_argument("--keep-f16", action="store_true", help="keep the F16 files once quantized")
    source = "GGUF whose tokenizer the random models copy (default: the packaged SmolLM2-135M)"
    p.add_argument("--tokenizer-from", help=source)


def llama_cpp_tools(folder: str | None) -> dict[str, str | None]:
    """Each of TOOLS: its path in `folder` (given: both must be there), else on the PATH."""
    folder = folder or os.environ.get(BIN_ENV)
    if folder is None:
        return {tool: shutil.which(tool) for tool in TOOLS}
    found = {tool: os.path.join(folder, tool) for tool in TOOLS}
    missing = [tool for tool, path in found.items() if not os.access(path, os.X_OK)]
    if missing:
        raise InvalidParameterError(
            "llama_cpp_bin", f"{folder} has no executable {' or '.join(missing)}"
        )
    return dict(found)


def quantized_model(
    shape: ModelShape, args: argparse.Namespace, quantize: str | None
) -> tuple[str | None, str]:
    """The --quant file of `shape` (written and quantized here unless --work has it), and a
    note of what was done; (None, why) where it cannot be made."""
    work, quant = Path(args.work), args.quant
    stem = shape.file_stem(args.seed)
    quantized, f16 = work / f"{stem}.{quant}.gguf", work / f"{stem}.F16.gguf"
    if quantized.exists():
        return str(quantized), f"{shape.name}: reused {quantized}"
    if quantize is None:
        return None, f"{shape.name}: skipped, writing its {quant} file needs llama-quantize"
    work.mkdir(parents=True, exist_ok=True)
    if not f16.exists():
        need = shape.f16_bytes() * 4 // 3  # the F16 and then its quantized copy beside it
        free = shutil.disk_usage(work).free
        if free < need:
            raise InvalidParameterError(
                "work",
                f"{shape.name} needs {need / GB:.1f} GB free in {work} for its F16 and "
                f"{quant} files; {free / GB:.1f} GB are free",
            )
        write_random_gguf(str(f16), shape, args.seed, args.tokenizer_from or default_model_path())
    partial = work / f"{stem}.{quant}.gguf.partial"
    done = subprocess.run(
        [quantize, str(f16), str(partial), quant], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        tail = done.stderr.strip()[-1500:]
        raise RuntimeError(f"llama-quantize failed on {f16} ({done.returncode}): {tail}")
    partial.replace(quantized)
    if not args.keep_f16:
        f16.unlink()
    return str(quantized), f"{shape.name}: wrote {quantized} (random N(0, 0.02), seed {args.seed})"


def llama_bench(
    tool: str, model: str, threads: int, steps: int, prompt_tokens: int = 0
) -> dict[str, Any]:
    """llama.cpp's decode time per token (tg, from an empty context), its time to process a
    `prompt_tokens`-token prompt in one batch (pp; none for 0), and the peak RSS of both."""
    command = [tool, "-m", model, "-t", str(threads), "-p", str(prompt_tokens)]
    run = run_measured([*command, "-n", str(steps), "-o", "json"], TIMEOUT_S)
    if run.returncode != 0:
        return {"error": run.failure("llama-bench")}
    tests = json.loads(run.stdout)
    tgs = [t for t in tests if t["n_prompt"] == 0 and t["n_gen"] > 0]
    if not tgs:
        return {"error": f"llama-bench printed no tg test: {run.stdout[-500:]}"}
    tg = tgs[0]
    figures = {
        "ms_per_token": tg["avg_ns"] / tg["n_gen"] / 1e6,
        "repetitions_ms": [round(ns / tg["n_gen"] / 1e6, 2) for ns in tg.get("samples_ns", [])],
        "peak_rss_bytes": run.peak_rss_bytes,
        "build": f"{tg.get('build_commit')} (build {tg.get('build_number')})",
    }
    if prompt_tokens == 0:
        return figures
    pps = [t for t in tests if t["n_prompt"] == prompt_tokens and t["n_gen"] == 0]
    if not pps:
        return figures | {"prompt_error": f"llama-bench printed no pp{prompt_tokens} test"}
    pp = pps[0]
    return figures | {
        "prompt_tokens": prompt_tokens,
        "prompt_ms": pp["avg_ns"] / 1e6,
        "prompt_tok_s": prompt_tokens * 1e9 / pp["avg_ns"],
        "prompt_repetitions_ms": [round(ns / 1e6, 2) for ns in pp.get("samples_ns", [])],
    }


def built_kernels() -> None:
    """The compiled CPU kernels, built in this process (cached for the probes) if they can be."""
    from pagedllm.kernels.cpu import load_cpu_ops  # imports torch: only when the bench runs

    with contextlib.suppress(KernelUnavailableError):  # the probe says which path it took
        load_cpu_ops()


def cpu_kind() -> str:
    """Which of this project's two CPU kinds runs the bench: "AVX-512 VNNI" or "AVX2"."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            vnni = any("avx512_vnni" in line for line in f if line.startswith("flags"))
    except OSError:
        return "unknown"
    return "AVX-512 VNNI" if vnni else "AVX2"


PROMPT_KEYS = ("prompt_tokens", "prompt_ms", "prompt_tok_s", "prompt_repetitions_ms")


def median_round(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One system's figures over the rounds: those of its round of median time per token,
    with the highest peak RSS of any round (the first failure, if a round failed), and the
    prompt's figures of its round of median prompt time (the first prompt_error, if any)."""
    failed = [r for r in rounds if "ms_per_token" not in r]
    if failed:
        return failed[0]
    ordered = sorted(rounds, key=lambda r: r["ms_per_token"])
    peak = max(r["peak_rss_bytes"] for r in rounds)
    median = ordered[(len(ordered) - 1) // 2] | {"peak_rss_bytes": peak}
    median = {k: v for k, v in median.items() if k not in PROMPT_KEYS and k != "prompt_error"}
    refused = [r for r in rounds if "prompt_error" in r]
    if refused:
        return median | {"prompt_error": refused[0]["prompt_error"]}
    timed = sorted((r for r in rounds if "prompt_ms" in r), key=lambda r: r["prompt_ms"])
    if not timed:
        return median
    return median | {key: timed[(len(timed) - 1) // 2][key] for key in PROMPT_KEYS}


def row_of(
    name: str, path: str, ours: dict[str, Any], theirs: dict[str, Any], read_rate: float
) -> dict[str, Any]:
    """The table's row for one model, from both systems' figures (median_round's)."""
    size = os.path.getsize(path)
    row: dict[str, Any] = {"model": name, "file": path, "file_gb": round(size / GB, 3)}
    if "ms_per_token" in theirs:
        row["llama_cpp_ms"] = round(theirs["ms_per_token"], 2)
        row["llama_cpp_rss_gb"] = round(theirs["peak_rss_bytes"] / GB, 3)
        row["llama_cpp_repetitions_ms"] = theirs["repetitions_ms"]
    if "ms_per_token" in ours:
        bound = size + ours["kv_pool_bytes"] + HEADROOM
        row["pagedllm_ms"] = round(ours["ms_per_token"], 2)
        row["floor_ms"] = round(1000 * ours["weight_bytes_per_step"] / read_rate, 2)
        row["pagedllm_rss_gb"] = round(ours["peak_rss_bytes"] / GB, 3)
        row["kv_pool_gb"] = round(ours["kv_pool_bytes"] / GB, 3)
        row["bound_gb"] = round(bound / GB, 3)
        row["within_bound"] = "yes" if ours["peak_rss_bytes"] <= bound else "no"
        for key in ("engine_s", "ready_s", "process_ready_s", "gguf_kernel"):
            row[key] = ours[key]
    for system, figures in (("llama_cpp", theirs), ("pagedllm", ours)):
        if "prompt_ms" in figures:
            row[f"{system}_prompt_tok_s"] = round(figures["prompt_tok_s"], 1)
            row[f"{system}_prompt_ms"] = round(figures["prompt_ms"], 2)
            row[f"{system}_prompt_repetitions_ms"] = figures["prompt_repetitions_ms"]
    row["ms_ratio"] = ratio(row.get("pagedllm_ms"), row.get("llama_cpp_ms"))
    row["prompt_ratio"] = ratio(row.get("pagedllm_prompt_tok_s"), row.get("llama_cpp_prompt_tok_s"))
    row["rss_ratio"] = ratio(row.get("pagedllm_rss_gb"), row.get("llama_cpp_rss_gb"))
    if "pagedllm_rss_gb" in row:  # llama-bench's context holds only its test's tokens
        row["pagedllm_rss_less_kv_gb"] = round(row["pagedllm_rss_gb"] - row["kv_pool_gb"], 3)
        row["rss_less_kv_ratio"] = ratio(
            row["pagedllm_rss_less_kv_gb"], row.get("llama_cpp_rss_gb")
        )
    errors = [figures["error"] for figures in (ours, theirs) if "error" in figures]
    errors += [f["prompt_error"] for f in (ours, theirs) if "prompt_error" in f]
    return row | ({"errors": errors} if errors else {})


def round_ratios(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each round's pagedllm / llama.cpp time per token and prompt tokens per second, and
    their medians (the row's ratios)."""
    ratios: dict[str, Any] = {}
    for key, name in (("ms_per_token", "ms"), ("prompt_tok_s", "prompt")):
        each = [
            a[key] / b[key]
            for a, b in zip(ours, theirs, strict=False)
            if key in a and key in b and b[key]
        ]
        if each:
            prefix = "" if name == "ms" else "prompt_"
            ratios[f"{prefix}round_ratios"] = [round(r, 3) for r in each]
            # median_low: the ratio of a round that ran, as median_round picks a round
            ratios[f"{name}_ratio"] = round(statistics.median_low(each), 2)
    return ratios


def run(args: argparse.Namespace) -> dict[str, Any]:
    for name in ("steps", "threads", "rounds"):
        if getattr(args, name) < 1:
            raise InvalidParameterError(name, f"--{name} must be at least 1")
    if args.prompt_tokens < 0:
        raise InvalidParameterError(
            "prompt_tokens", "--prompt-tokens must be at least 0 (0: no prompt timed)"
        )
    tools = llama_cpp_tools(args.llama_cpp_bin)
    notes: list[str] = []
    if tools["llama-bench"] is None:
        notes.append(
            "llama.cpp not found (llama-bench is neither in --llama-cpp-bin, "
            f"${BIN_ENV}, nor on the PATH): pagedllm's figures only"
        )
    built_kernels()  # a probe building them would report the compiler's peak memory as its own
    read_rate = read_bytes_per_second()
    rows, builds = [], set()
    for name in args.models:
        if name == PACKAGED:
            path: str | None = default_model_path()
        else:
            path, note = quantized_model(SHAPES[name], args, tools["llama-quantize"])
            notes.append(note)
            if args.quant != QUANT:  # the row says which file it timed
                name = f"{name} {args.quant}"
        if path is None:
            continue
        load = round(os.getloadavg()[0], 2)  # other work on the cores sways both figures
        theirs: list[dict[str, Any]] = []
        ours: list[dict[str, Any]] = []
        for _ in range(args.rounds):
            if tools["llama-bench"] is not None:
                bench = llama_bench(
                    tools["llama-bench"], path, args.threads, args.steps, args.prompt_tokens
                )
                theirs.append(bench)
                builds.add(bench.get("build"))
            ours.append(
                probe_pagedllm(
                    path,
                    args.steps,
                    args.threads,
                    args.kv_cache_memory,
                    args.prompt_tokens,
                    TIMEOUT_S,  # six N-token prompts on the 7B shape take minutes
                )
            )
        row = row_of(name, path, median_round(ours), median_round(theirs or [{}]), read_rate)
        rows.append(row := row | {"load_1m": load} | round_ratios(ours, theirs))
        notes += [f"{name}: {error}" for error in row.get("errors", [])]
    config = {"threads": args.threads, "steps": args.steps, "rounds": args.rounds}
    config["prompt_tokens"] = args.prompt_tokens
    config["quant"] = args.quant
    config["kv_cache_memory"] = args.kv_cache_memory
    config |= {"cpu_kind": cpu_kind(), "read_gb_per_s": round(read_rate / GB, 1)}
    config["llama_cpp_bin"] = os.path.dirname(tools["llama-bench"] or "") or None
    config["llama_cpp_build"] = ", ".join(sorted(str(b) for b in builds if b)) or None
    notes += [
        f"{args.rounds} rounds per model, llama.cpp then pagedllm; each system's figures are "
        "those of its median round (peak RSS: the highest); pagedllm / llama.cpp is the "
        "median of the rounds' ratios (JSON: round_ratios)",
        f"one stream, {args.threads} threads each; ms/token: llama.cpp's tg{args.steps} test "
        f"of `llama-bench -p {args.prompt_tokens} -n {args.steps}` (mean of its repetitions, "
        "from an empty context); pagedllm's "
        f"median decode step at batch 1 over {args.steps} steps after a {PROMPT_LEN}-token "
        "prompt "
        "(`bench decode`'s timing: scheduling, sampling and output processing included)",
        "peak RSS: each system's own process (wait4's ru_maxrss), over load and generation; "
        "mapped file pages it touched count; pagedllm's includes its whole KV pool (zeroed "
        "at start), llama-bench's a context of its test's tokens only (JSON: "
        "pagedllm_rss_less_kv_gb, rss_less_kv_ratio)"
        + (
            f"; one llama-bench call runs both its tests (pp{args.prompt_tokens}, then "
            f"tg{args.steps}), so its peak covers both, and pagedllm's the prompt's step too"
            if args.prompt_tokens
            else ""
        ),
        "ready to serve: from the start of pagedllm's engine construction (memory check, "
        "load, KV pool) to the token after a one-token prompt; 'from process start' adds "
        "Python's start and imports",
        f"weights-read floor: the bytes of weights a pagedllm step reads, at the "
        f"{read_rate / GB:.1f} GB/s this machine read a 512 MiB buffer",
        f"bound: the file + pagedllm's KV pool ({args.kv_cache_memory}) + 0.5 GB",
        "in the JSON: llama-bench's repetitions (ms/token each), and the 1-minute load "
        "average as each model's runs began",
    ]
    if args.prompt_tokens:
        notes.append(
            f"prompt tok/s: {args.prompt_tokens} tokens / the time to process a prompt of "
            f"that many tokens in one batch: llama.cpp's pp{args.prompt_tokens} test (the "
            f"mean of its repetitions' times); pagedllm's median of {PROMPT_REPETITIONS} "
            "engine steps, each a fresh request of new random token ids (no prefix-cache "
            "hit) after a warm-up one, the token budget raised so that the whole prompt is "
            "one step (scheduling, the forward pass and sampling the first token); "
            "prompt: pagedllm / llama.cpp is of tokens per second: higher is better for "
            "pagedllm, unlike the ms/token ratio (JSON: prompt_round_ratios; each "
            "system's prompt_ms and prompt_repetitions_ms)"
        )
    result = options.new_result("llamacpp", args, "GGUF files (see rows)", config, rows, notes)
    for row in rows:
        result["ratios"][row["model"]] = {"ms": row["ms_ratio"], "rss": row["rss_ratio"]}
        if args.prompt_tokens:
            result["ratios"][row["model"]]["prompt"] = row["prompt_ratio"]
    result["exit_code"] = 1 if any("errors" in row for row in rows) else 0
    columns = f"{COLUMNS}|{PROMPT_COLUMNS}" if args.prompt_tokens else COLUMNS
    return write_outputs(result, args.out, columns)
