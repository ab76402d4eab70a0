"""`pagedllm bench lora`: many LoRA adapters of one base (S-LoRA's benchmarks), each set
of rows beside its baseline in the same process, on the same requests and KV pool:

1. throughput of a ShareGPT-shaped load spread over 1, 8, 32 and 128 random adapters
   (uniform and Zipf-skewed assignment) against the base alone and against one adapter
   merged into the base (W + scale * B A: the same model, no LoRA compute);
2. unified paging (adapters in pages of the KV pool, evicted LRU) against
   `lora_slots="static"` (vLLM's fixed slots) with the same pool: requests/s, concurrent
   sequences, adapter loads per second, preemptions;
3. transformers + PEFT on the same adapters, batches grouped by adapter (`set_adapter`
   per batch, as in S-LoRA's table); skipped when peft is not installed.
The adapters are written by the bench (bench/lora_adapters.py) into a temporary folder.
"""

from __future__ import annotations

import argparse
import importlib.util
import tempfile
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from pagedllm.bench import options
from pagedllm.bench.baselines import generate, load_hf_model, pack_static_batches
from pagedllm.bench.lora_adapters import (
    DISTRIBUTIONS,
    TARGET_SETS,
    AdapterSpec,
    assign_adapters,
    merge_adapter,
    write_adapters,
)
from pagedllm.bench.output import Plot, add_ratios, ratio, write_outputs
from pagedllm.bench.sweep import build_engine, run_workload
from pagedllm.bench.workload import BenchRequest
from pagedllm.engine.config import EngineConfig
from pagedllm.errors import InvalidParameterError
from pagedllm.loader import LoadedModel
from pagedllm.lora import LoRARequest
from pagedllm.worker.quantization_choice import resolve_quantization

# Prefix caching off: random prompts share nothing. Dequantized weights by default: the
# merged baseline needs them (a GGUF's blocks cannot take W + B A), and every row then
# computes the same base. Four static slots: vLLM's one would serve one adapter at a time.
ENGINE = {"enable_prefix_caching": False, "kv_cache_memory": None, "quantization": "none"}
ENGINE |= {"max_loras": 4}
COLUMNS = (
    "system=system|adapters=adapters|distribution=assignment|adapters_used=used|"
    "requests_per_s=req/s|generated_tokens_per_s=gen tok/s|mean_running_seqs=mean seqs|"
    "peak_running_seqs=peak seqs|lora_loads=loads|lora_loads_per_s=loads/s|"
    "lora_evictions=evictions|preemptions=preempt|generated_tokens_per_s_vs_base=tok/s vs base|"
    "generated_tokens_per_s_vs_merged=tok/s vs merged|requests_per_s_vs_unified=req/s vs "
    "unified|generated_tokens_per_s_vs_peft=tok/s vs peft"
)
SAME_TOKENS = "greedy, ignore_eos, max_tokens = each request's output length: every system "
SAME_TOKENS += "generates as many tokens; prefix caching off"


def add_parser(sub: Any) -> None:
    text = "many LoRA adapters: throughput, unified paging vs static slots, PEFT"
    p = sub.add_parser("lora", help=text)
    workload = {"num_prompts": 32, "scale": 0.25}
    options.add_bench_args(p, "lora", run, workload, ENGINE)
    text = "adapter counts (default: 1,8,32,128)"
    p.add_argument("--num-adapters", type=options.int_list, default="1,8,32,128", help=text)
    text = "how requests pick adapters: uniform, zipf (default: both)"
    p.add_argument(
        "--distributions", type=options.choice_list(DISTRIBUTIONS, "distribution"), help=text
    )
    p.add_argument("--zipf-alpha", type=float, default=1.0, help="Zipf exponent (default: 1.0)")
    p.add_argument("--lora-rank", type=int, default=8, help="the adapters' rank (default: 8)")
    text = "target modules: qv (q_proj, v_proj; default) or all seven projections"
    p.add_argument("--lora-targets", choices=TARGET_SETS, default="qv", help=text)
    text = "adapters of the unified vs static comparison, uniform (default: 32; 0 skips it)"
    p.add_argument("--paging-adapters", type=int, default=32, help=text)
    text = "adapters of the transformers + PEFT run, uniform (default: 8; 0 skips it)"
    p.add_argument("--peft-adapters", type=int, default=8, help=text)
    text = "engine runs of each system, interleaved; its fastest is kept (default: 1)"
    p.add_argument("--rounds", type=int, default=1, help=text)


def lora_requests(assignment: Sequence[int], paths: Sequence[str]) -> list[LoRARequest]:
    """Each request's LoRARequest: adapter k is `adapter-<k>` with id k + 1 (0 is the base)."""
    return [LoRARequest(f"adapter-{k}", k + 1, paths[k]) for k in assignment]


def engine_row(
    args: argparse.Namespace,
    loaded: LoadedModel,
    requests: Sequence[BenchRequest],
    system: str,
    variant: dict[str, Any],
    lora: Sequence[LoRARequest] | None = None,
) -> dict[str, Any]:
    """One fresh engine with the command line's options and `variant`, over the requests
    (under `lora`, one per request): run_workload's row and the adapter figures."""
    engine, _ = build_engine(loaded, options.engine_kwargs(args, loaded, **variant))
    before = engine.snapshot()
    row = run_workload(engine, requests, lora_requests=lora).row
    after = engine.snapshot()
    engine.shutdown()
    loads = after.lora_loads - before.lora_loads
    row |= {"system": system, "lora_loads": loads}
    row["lora_evictions"] = after.lora_evictions - before.lora_evictions
    row["lora_loads_per_s"] = round(loads / row["seconds"], 3)
    row["adapter_blocks_at_start"] = before.usage.adapter_blocks  # static: its reserve
    print(f"  {system}: {row['generated_tokens_per_s']} tok/s", flush=True)
    return row


def lora_row(
    args: argparse.Namespace,
    loaded: LoadedModel,
    requests: Sequence[BenchRequest],
    paths: Sequence[str],
    case: tuple[int, str, str],
) -> dict[str, Any]:
    """The requests under `n` adapters assigned by `dist`, with `slots` paging."""
    n, dist, slots = case
    assignment = assign_adapters(len(requests), n, dist, args.seed, args.zipf_alpha)
    variant = {"enable_lora": True, "lora_slots": slots}
    system = f"{'lora' if slots == 'unified' else 'static'} {n} {dist}"
    row = engine_row(args, loaded, requests, system, variant, lora_requests(assignment, paths))
    return row | {"adapters": n, "distribution": dist, "adapters_used": len(set(assignment))}


def run_peft(
    loaded: LoadedModel,
    requests: Sequence[BenchRequest],
    assignment: Sequence[int],
    paths: Sequence[str],
    opts: dict[str, Any],
) -> dict[str, Any]:
    """transformers + PEFT: every adapter used loaded once; then, adapter by adapter
    (`set_adapter`), its requests in static batches packed to the engine's KV budget as
    the transformers baseline packs them (baselines.py). A row, or a note why not."""
    if importlib.util.find_spec("peft") is None:
        return {"note": "peft is not installed (pip install 'pagedllm[dev]'): skipped"}
    from peft import PeftModel

    used = list(dict.fromkeys(assignment))
    model = PeftModel.from_pretrained(load_hf_model(loaded), paths[used[0]], str(used[0]))
    for k in used[1:]:
        model.load_adapter(paths[k], adapter_name=str(k))
    model.eval()
    generate(model, [BenchRequest((1, 2, 3, 4), 2)])  # warm-up
    kv_tokens = options.kv_budget_tokens(loaded, opts)
    num_batches, start = 0, time.perf_counter()
    for k in used:
        model.set_adapter(str(k))
        group = [r for r, a in zip(requests, assignment, strict=True) if a == k]
        for batch in pack_static_batches(group, kv_tokens, opts["max_num_seqs"]):
            generate(model, batch)
            num_batches += 1
    seconds = time.perf_counter() - start
    generated = sum(r.output_len for r in requests)
    row = {"system": "peft", "requests": len(requests), "generated_tokens": generated}
    row |= {"seconds": round(seconds, 3), "requests_per_s": round(len(requests) / seconds, 3)}
    row |= {"generated_tokens_per_s": round(generated / seconds, 2), "num_batches": num_batches}
    row |= {"adapters_used": len(used), "preemptions": 0}
    row["note"] = (
        f"{num_batches} static left-padded batches, each of one adapter (set_adapter), "
        "packed to the same KV budget knowing every output length"
    )
    return row


def with_ratio(
    result: dict[str, Any], row: dict[str, Any], base: dict[str, Any], key: str, name: str
) -> None:
    """`row`'s `<key>_vs_<name>` against the row `base`, also in the result's ratios."""
    row[f"{key}_vs_{name}"] = ratio(row.get(key), base.get(key))
    result["ratios"].setdefault(row["system"], {})[f"{key}_vs_{name}"] = row[f"{key}_vs_{name}"]


def merged_model(args: argparse.Namespace, loaded: LoadedModel, path: str) -> LoadedModel | None:
    """The base with the adapter at `path` merged in, or None where the engine would not
    compute on dequantized weights (a GGUF's blocks: "auto" decided for the file)."""
    config = EngineConfig(**options.engine_kwargs(args, loaded))
    if resolve_quantization(config.runner_options, args.model).quantization == "gguf":
        return None
    return merge_adapter(loaded, path)


def fastest_of_rounds(jobs: dict[Any, Callable[[], dict[str, Any]]], rounds: int) -> dict:
    """Each job's row from the round in which it generated fastest (the one other work on
    the machine disturbed least), the jobs interleaved round by round; `tok_s_rounds`
    lists every round's figure."""
    best: dict[Any, dict[str, Any]] = {}
    for _ in range(rounds):
        for key, job in jobs.items():
            row, prior = job(), best.get(key)
            speeds = [*(prior["tok_s_rounds"] if prior else []), row["generated_tokens_per_s"]]
            if prior is None or row["generated_tokens_per_s"] > prior["generated_tokens_per_s"]:
                best[key] = row
            best[key]["tok_s_rounds"] = speeds
    return best


def run(args: argparse.Namespace) -> dict[str, Any]:
    spec = AdapterSpec(rank=args.lora_rank, targets=TARGET_SETS[args.lora_targets])
    if spec.rank > args.max_lora_rank:
        raise InvalidParameterError(
            "lora_rank", f"--lora-rank {spec.rank} is above --max-lora-rank {args.max_lora_rank}"
        )
    if min(args.num_adapters) < 1:
        raise InvalidParameterError("num_adapters", "adapter counts must be >= 1")
    if args.rounds < 1:
        raise InvalidParameterError("rounds", f"--rounds must be >= 1, got {args.rounds}")
    dists = args.distributions or list(DISTRIBUTIONS)
    # One adapter: every assignment is the same, so it runs once.
    cases = [(n, d, "unified") for n in args.num_adapters for d in (dists if n > 1 else dists[:1])]
    paging, peft_n = args.paging_adapters, args.peft_adapters
    if paging:
        cases += [(paging, "uniform", "unified"), (paging, "uniform", "static")]
    if peft_n:
        cases.append((peft_n, "uniform", "unified"))
    cases = list(dict.fromkeys(cases))
    loaded, opts, requests, result = options.prepare("lora", args)
    result["config"] |= {"lora_rank": spec.rank, "lora_targets": ",".join(spec.targets)}
    result["config"] |= {"max_lora_rank": args.max_lora_rank, "max_loras": args.max_loras}
    result["config"] |= {"max_cpu_loras": args.max_cpu_loras, "zipf_alpha": args.zipf_alpha}
    result["config"]["rounds"] = args.rounds
    rows, notes = result["results"], result["notes"]
    with tempfile.TemporaryDirectory(prefix="pagedllm-lora-bench-") as folder:
        paths = write_adapters(loaded.config, folder, max(c[0] for c in cases), spec, args.seed)
        jobs: dict[Any, Callable[[], dict[str, Any]]] = {
            "base": partial(engine_row, args, loaded, requests, "base", {})
        }
        merged = merged_model(args, loaded, paths[0])
        if merged is not None:
            jobs["merged"] = partial(engine_row, args, merged, requests, "merged", {})
        notes += [] if merged else ["merged: skipped, the GGUF's blocks take no W + B A"]
        for case in cases:
            jobs[case] = partial(lora_row, args, loaded, requests, paths, case)
        runs = fastest_of_rounds(jobs, args.rounds)
        del merged
        rows += runs.values()
        if paging:
            static, unified = runs[paging, "uniform", "static"], runs[paging, "uniform", "unified"]
            for key in ("requests_per_s", "mean_running_seqs", "lora_loads_per_s"):
                with_ratio(result, static, unified, key, "unified")
        if peft_n:
            assignment = assign_adapters(len(requests), peft_n, "uniform", args.seed)
            peft = run_peft(loaded, requests, assignment, paths, opts)
            notes.append(f"peft: {peft.pop('note')}")
            if "generated_tokens" in peft:
                rows.append(peft | {"adapters": peft_n, "distribution": "uniform"})
                ours = runs[peft_n, "uniform", "unified"]
                with_ratio(result, ours, peft, "generated_tokens_per_s", "peft")
    add_ratios(result, "generated_tokens_per_s", ["base", "merged"])
    notes += [
        SAME_TOKENS,
        f"adapters: random PEFT LoRA, rank {spec.rank} on {', '.join(spec.targets)}, fp32, "
        "written by the bench; used: distinct adapters the requests name",
        "lora: adapters in pages of the KV pool (unified paging), loaded on first use, evicted "
        f"LRU when KV needs room; static: {args.max_loras} slots of rank {args.max_lora_rank} "
        "on every target reserved from the same pool at start (adapter_blocks_at_start)",
        "loads: adapters written into the pool (the snapshot's lora_loads), per second of run",
        "the machine is shared with other work: absolute figures move with its load; engine "
        f"rows: the fastest of {args.rounds} interleaved round(s) (tok_s_rounds: each round's)",
    ]
    names = [r["system"] for r in rows]
    bars = {"_": (names, [r["generated_tokens_per_s"] for r in rows])}
    plot = Plot("tokens_per_s", "Throughput by system", "", "generated tokens/s", bars, "bar")
    return write_outputs(result, args.out, COLUMNS, [plot])
