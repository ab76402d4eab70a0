"""The one sweep runner: drive `LLMEngine.step()` over a workload and account for the KV
pool every step, over the real model or, for a bookkeeping run, over FakeModelRunner (the
same scheduler and block manager, no model; time in steps). Requests come at their
arrival times; an idle clock skips to the next one. Each slot of a running sequence holds
a token, is reserved for the request's later tokens, or is wasted (the paper's Fig. 2).
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagedllm.bench.options import engine_kwargs
from pagedllm.bench.output import Plot
from pagedllm.bench.workload import BenchRequest
from pagedllm.engine.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.snapshot import EngineSnapshot
from pagedllm.loader import LoadedModel
from pagedllm.lora import LoRARequest
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.factory import RealRunner, build_runner
from pagedllm.worker.fake_runner import FakeModelRunner
from pagedllm.worker.quantization_choice import resolve_quantization
from pagedllm.worker.runner import ModelSpec

SLOT_KINDS = ("tokens", "reserved", "wasted")
SERIES = ("t", "running", "used_blocks", "utilization")  # sampled every step


@dataclass(frozen=True)
class SweepRun:
    row: dict[str, Any]  # the figures of the bench's table
    timeline: dict[str, list[float]]  # SERIES, at most 400 points of each
    latency: dict[str, dict[str, Any]]  # per request: arrival, first_token, finish, output_len


def count_slots(snapshot: EngineSnapshot, final_len: dict[str, int], slots: dict[str, int]) -> int:
    """Add the running sequences' slots by kind to `slots`; the most empty slots of one."""
    most_empty = 0
    for table in snapshot.tables:
        cap, stored = table.capacity, table.num_tokens
        will_fill = max(stored, min(cap, final_len[table.request_id]))
        slots["tokens"] += stored
        slots["reserved"] += will_fill - stored
        slots["wasted"] += cap - will_fill
        most_empty = max(most_empty, cap - stored)
    return most_empty


def run_workload(
    engine: LLMEngine,
    requests: Sequence[BenchRequest],
    clock: str = "wall",
    lora_requests: Sequence[LoRARequest | None] | None = None,
) -> SweepRun:
    """Run every request to completion; `clock` is "wall" (seconds) or "steps";
    `lora_requests`: the adapter each request runs under (None: the base)."""
    pending = sorted(range(len(requests)), key=lambda i: requests[i].arrival_time)
    final_len = {str(i): r.total_len for i, r in enumerate(requests)}
    samples: list[tuple[float, int, int, float]] = []
    slots, most_empty = dict.fromkeys(SLOT_KINDS, 0), 0
    first: dict[str, float] = {}
    finish: dict[str, float] = {}
    begin = engine.snapshot()
    generated, preempted = 0, begin.num_preemptions
    skipped = step_seconds = 0.0  # skipped: idle time jumped over to the next arrival
    start = time.perf_counter()

    def now() -> float:
        return skipped + (len(samples) if clock == "steps" else time.perf_counter() - start)

    while pending or engine.has_unfinished_requests():
        while pending and requests[pending[0]].arrival_time <= now():
            r = requests[i := pending.pop(0)]
            params = SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0)
            lora = {"lora_request": lora_requests[i]} if lora_requests else {}
            engine.add_request(str(i), list(r.prompt_token_ids), params, **lora)
        if not engine.has_unfinished_requests():
            skipped += requests[pending[0]].arrival_time - now()
            continue
        steps, t0 = engine.stats.steps, time.perf_counter()
        outputs = engine.step()
        step_seconds += time.perf_counter() - t0
        if engine.stats.steps == steps:
            raise RuntimeError("the engine made no progress with requests waiting")
        t, done = now(), [out for out in outputs if out.finished]
        for out in outputs:
            first.setdefault(out.request_id, t)
        for out in done:
            finish[out.request_id] = t
            generated += sum(len(c.token_ids) for c in out.outputs)
        ran = engine.stats.last
        if ran is None:
            raise RuntimeError("the engine ran a step without its stats hearing of it")
        # The step as it ran: the requests that finished in it still count.
        samples.append((t, ran.num_running_seqs, ran.usage.used_blocks, ran.usage.utilization))
        most_empty = max(most_empty, count_slots(engine.snapshot(tables=True), final_len, slots))
    series = dict(zip(SERIES, map(list, zip(*samples, strict=True)), strict=True))
    n, total = len(samples), sum(slots.values())
    row = {"system": engine.config.kv_reservation, "requests": len(requests), "steps": n}
    end = engine.snapshot()
    row |= {"generated_tokens": generated, "kv_blocks": end.usage.num_blocks}
    row["preemptions"] = end.num_preemptions - preempted
    row["mean_running_seqs"] = round(sum(series["running"]) / n, 2)
    row["peak_running_seqs"] = max(series["running"])
    row["peak_used_blocks"] = max(series["used_blocks"])
    row["kv_utilization"] = round(sum(series["utilization"]) / n, 4)  # mean over steps
    row |= {f"slots_{k}_frac": round(v / total, 4) if total else None for k, v in slots.items()}
    row["max_empty_slots_per_seq"] = most_empty
    if engine.config.speculative_config is not None:  # this run's share of the figures
        checks = end.spec_checks - begin.spec_checks
        proposed = end.spec_proposed_tokens - begin.spec_proposed_tokens
        accepted = end.spec_accepted_tokens - begin.spec_accepted_tokens
        row["spec_acceptance_rate"] = round(accepted / proposed, 4) if proposed else 0.0
        row["spec_mean_accepted_length"] = round(1 + accepted / checks, 3) if checks else 0.0
    if clock == "wall":  # with arrivals, the rates count the idle time skipped
        row["seconds"] = round(time.perf_counter() - start, 3)
        row["requests_per_s"] = round(len(requests) / now(), 3)
        row["generated_tokens_per_s"] = round(generated / now(), 2)
        row["step_ms"] = round(1000 * step_seconds / n, 2)
    timeline = {k: [round(x, 4) for x in v[:: -(-n // 400)]] for k, v in series.items()}
    latency = {
        str(i): {"arrival": r.arrival_time, "output_len": r.output_len}
        | {"first_token": first.get(str(i)), "finish": finish.get(str(i))}
        for i, r in enumerate(requests)
    }
    return SweepRun(row, timeline, latency)


def engine_over_runner(
    config: EngineConfig, loaded: LoadedModel, profile_attention: bool = False
) -> tuple[LLMEngine, RealRunner]:
    """An engine over a runner built here, so that the bench holds the runner it measures
    (`profile_attention`: the runner adds up its seconds in attention). Quantization "auto"
    is decided for the model's file, as an engine loading it would: a bench measures the
    default path whatever form `loaded` has (build_runner loads the file's blocks for
    gguf)."""
    options = resolve_quantization(config.runner_options, config.model)
    config = config.with_quantizations_of(options)
    runner, tokenizer = build_runner(
        options, config.model, loaded, profile_attention=profile_attention
    )
    return LLMEngine(config, runner=runner, tokenizer=tokenizer), runner


def build_engine(
    loaded: LoadedModel, options: dict[str, Any], fake: bool = False, time_attention: bool = False
) -> tuple[LLMEngine, RealRunner | None]:
    """A fresh engine, warmed up, and its runner (None over FakeModelRunner)."""
    gc.collect()  # the previous engine's KV pool goes before this one is allocated
    if fake:
        cfg = loaded.config
        spec = ModelSpec(
            cfg.vocab_size,
            cfg.max_position_embeddings,
            num_layers=cfg.num_hidden_layers,
            layer_windows=cfg.layer_windows,
        )
        return LLMEngine(EngineConfig(**options), runner=FakeModelRunner(spec, token=0)), None
    engine, runner = engine_over_runner(EngineConfig(**options), loaded, time_attention)
    run_workload(engine, [BenchRequest((1, 2, 3, 4), 2)])  # first-call costs stay out of timings
    return engine, runner


def attention_seconds(runner: RealRunner | None) -> float:
    """The runner's seconds in attention so far (0 when it does not time them)."""
    seconds = None if runner is None else runner.attention_seconds
    return 0.0 if seconds is None else seconds


def sweep(
    args: argparse.Namespace,
    loaded: LoadedModel,
    requests: Sequence[BenchRequest],
    variants: Sequence[dict[str, Any]],
    fake: bool = False,
    time_attention: bool = False,
) -> list[SweepRun]:
    """One fresh engine per variant of the command line's engine options, in turn; `fake`
    runs over FakeModelRunner with a clock in steps."""
    runs = []
    for variant in variants:
        opts = engine_kwargs(args, loaded, **variant)
        engine, runner = build_engine(loaded, opts, fake, time_attention)
        before = attention_seconds(runner)  # the warm-up's attention stays out
        runs.append(run := run_workload(engine, requests, "steps" if fake else "wall"))
        if time_attention and runner is not None:
            seconds = attention_seconds(runner) - before
            run.row["attention_ms_per_step"] = round(1000 * seconds / run.row["steps"], 3)
        del engine, runner  # its KV pool goes before the next one is allocated
        done = f"{run.row['steps']} steps" if fake else f"{run.row['generated_tokens_per_s']} tok/s"
        print(f"  {', '.join(f'{k}={v}' for k, v in variant.items())}: {done}", flush=True)
    return runs


def timeline_plots(timelines: dict[str, dict[str, list[float]]], unit: str) -> list[Plot]:
    """KV utilisation and running sequences over time, a line per policy."""
    lines = {k: {p: (tl["t"], tl[k]) for p, tl in timelines.items()} for k in SERIES[1:]}
    return [
        Plot("utilization", "KV utilisation", unit, "", lines["utilization"], ylim=(0, 1.05)),
        Plot("running", "Requests in the batch", unit, "sequences", lines["running"]),
    ]
