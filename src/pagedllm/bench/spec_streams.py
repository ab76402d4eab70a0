"""`pagedllm bench spec-streams`: n-gram speculation at many streams, on natural text.

Two workloads built from the texts the package ships, never from random token ids:
"copy" asks the model to repeat, rewrite or summarize a paragraph of
bench/data/quality_text.txt (its output copies its input: proposals are often accepted);
"chat" asks the questions of bench/data/quality_prompts.txt (answers that do not copy
their input: proposals are seldom accepted). For each workload and stream count N, N
requests stay in flight (a stream whose request ends takes the next prompt), greedy, EOS
honoured, first without speculation and then with n-gram proposals (k 4, prompt lookup
2..4 unless the flags say otherwise), each on a fresh engine.

`--sweep` runs the chat workload at 1, 2, 4, ..., 64 streams and names the smallest batch
size from which speculating costs throughput: a value for
`--speculative-disable-by-batch-size`.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedllm.bench import options
from pagedllm.bench.datasets import COPY_CHARS, shipped_paragraphs
from pagedllm.bench.output import Plot, ratio, write_outputs
from pagedllm.bench.sweep import build_engine
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.engine_args import engine_options
from pagedllm.entrypoints.server.chat_template import encode_chat
from pagedllm.errors import InvalidParameterError
from pagedllm.sampling_params import SamplingParams
from pagedllm.validation import check_int

DATA = Path(__file__).parent / "data"
WORKLOADS = ("copy", "chat")
SWEEP_STREAMS = [1, 2, 4, 8, 16, 32, 64]
# The instructions of the copy workload, cycled with the paragraphs.
COPY_INSTRUCTIONS = (
    "Repeat this text exactly:",
    "Rewrite this text, fixing nothing and changing nothing:",
    "Summarize this text:",
)
NGRAM_DEFAULTS = dict(num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=4)
SPEC_KEYS = ("speculative_method", *NGRAM_DEFAULTS, "speculative_disable_by_batch_size")
COLUMNS = (
    "workload=workload|streams=streams|mode=mode|tokens_per_s=tokens/s|ratio=vs off"
    "|full_batch_tokens_per_s=tokens/s, full batch|full_batch_ratio=vs off, full batch"
    "|mean_running=mean batch|acceptance_rate=accepted|mean_accepted_length=tokens per check"
    "|same_tokens=same tokens as off"
)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "spec-streams",
        help="n-gram speculation at many streams on natural text (copy and chat workloads)",
    )
    options.add_bench_args(p, "spec-streams", run, engine={"kv_cache_memory": "2GiB"})
    p.add_argument("--streams", type=options.int_list, help="requests in flight (default: 1,8,64)")
    p.add_argument(
        "--workloads",
        type=options.choice_list(WORKLOADS, "workload"),
        help=f"comma list of {', '.join(WORKLOADS)} (default: both)",
    )
    p.add_argument("--max-tokens", type=int, default=128, help="per request (EOS ends it sooner)")
    p.add_argument(
        "--requests-per-stream",
        type=int,
        default=2,
        help="requests each stream runs in turn: N streams run N times this many",
    )
    p.add_argument(
        "--sweep",
        action="store_true",
        help="the chat workload at 1,2,4,...,64 streams (or --streams): the batch size from "
        "which speculating costs throughput",
    )


# ------------------------------------------------------------------ the prompts
def paragraphs() -> list[str]:
    """The shipped paragraphs long enough to copy, each cut as `bench serve --dataset copy`
    cuts them."""
    return [p[:COPY_CHARS] for p in shipped_paragraphs()]


def questions() -> list[str]:
    text = (DATA / "quality_prompts.txt").read_text(encoding="utf-8")
    return [line.strip() for line in text.splitlines() if line.strip()]


def workload_messages(workload: str, count: int) -> list[str]:
    """`count` user messages of `workload`, cycling its texts (and, for copy, its
    instructions: consecutive prompts differ in both)."""
    if workload == "copy":
        paras = paragraphs()
        return [
            f"{COPY_INSTRUCTIONS[i % len(COPY_INSTRUCTIONS)]}\n\n{paras[i % len(paras)]}"
            for i in range(count)
        ]
    if workload == "chat":
        asked = questions()
        return [asked[i % len(asked)] for i in range(count)]
    raise InvalidParameterError("workloads", f"unknown workload {workload!r}")


def workload_prompts(tokenizer: Any, workload: str, count: int) -> list[list[int]]:
    """The workload's prompts as chat-template token ids."""
    return [
        encode_chat(tokenizer, [{"role": "user", "content": message}], True)
        for message in workload_messages(workload, count)
    ]


# ------------------------------------------------------------------ one run
@dataclass(frozen=True)
class StreamsRun:
    """What one engine did with a workload at a stream count."""

    tokens: list[list[int]]  # the generated ids of each prompt, in prompt order
    seconds: float
    steps: int
    full_batch_tokens: int  # generated in the steps that ran `streams` sequences
    full_batch_seconds: float
    running_sum: int  # running sequences added over the steps (for the mean batch)

    @property
    def generated(self) -> int:
        return sum(len(t) for t in self.tokens)


def run_streams(
    engine: LLMEngine, prompts: Sequence[list[int]], streams: int, max_tokens: int
) -> StreamsRun:
    """Every prompt once, greedy, at most `streams` requests in flight: a request that
    ends hands its stream to the next prompt before the next step (a closed loop)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    tokens: list[list[int]] = [[] for _ in prompts]
    next_prompt = in_flight = steps = full_tokens = running_sum = 0
    full_seconds = 0.0
    start = time.perf_counter()
    while next_prompt < len(prompts) or engine.has_unfinished_requests():
        while in_flight < streams and next_prompt < len(prompts):
            engine.add_request(str(next_prompt), prompts[next_prompt], params)
            next_prompt += 1
            in_flight += 1
        t0 = time.perf_counter()
        outputs = engine.step()
        seconds = time.perf_counter() - t0
        made = 0
        for out in outputs:
            ids = out.outputs[0].token_ids
            i = int(out.request_id)
            made += len(ids) - len(tokens[i])
            tokens[i] = list(ids)
            in_flight -= int(out.finished)
        ran = engine.stats.last
        if ran is None:
            raise RuntimeError("the engine ran a step without its stats hearing of it")
        steps += 1
        running_sum += ran.num_running_seqs
        if ran.num_running_seqs >= streams:
            full_tokens += made
            full_seconds += seconds
    return StreamsRun(
        tokens, time.perf_counter() - start, steps, full_tokens, full_seconds, running_sum
    )


def run_row(
    workload: str, streams: int, mode: str, got: StreamsRun, base: StreamsRun | None
) -> dict[str, Any]:
    """One line of the table; `base`: the run without speculation (None: this is it)."""
    tok_s = got.generated / got.seconds
    full = got.full_batch_tokens / got.full_batch_seconds if got.full_batch_seconds else None
    row: dict[str, Any] = {"workload": workload, "streams": streams, "mode": mode}
    row |= {"requests": len(got.tokens), "generated_tokens": got.generated}
    row |= {"seconds": round(got.seconds, 3), "steps": got.steps}
    row |= {"tokens_per_s": round(tok_s, 2), "full_batch_tokens_per_s": full and round(full, 2)}
    row["mean_running"] = round(got.running_sum / got.steps, 2) if got.steps else 0.0
    pairs = zip(got.tokens, (base or got).tokens, strict=True)
    differing = sum(a != b for a, b in pairs)
    row["differing_requests"] = differing
    row["same_tokens"] = differing == 0
    return row


# ------------------------------------------------------------------ the bench
def spec_options(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """The engine options without speculation, and the n-gram options added to them
    (k and prompt lookup from the flags, else the single-stream bench's defaults)."""
    opts = engine_options(args)
    spec = {"speculative_method": "ngram"}
    spec |= {k: v if opts.get(k) is None else opts[k] for k, v in NGRAM_DEFAULTS.items()}
    # Unless the flag sets a limit: speculate at every batch size measured (the engine's
    # default limit is what the sweep measures).
    limit = opts.get("speculative_disable_by_batch_size")
    spec["speculative_disable_by_batch_size"] = limit or opts["max_num_seqs"] + 1
    return opts | dict.fromkeys(SPEC_KEYS), spec


def disable_threshold(rows: Sequence[dict[str, Any]], key: str = "full_batch_ratio") -> int | None:
    """The smallest stream count from which n-gram speculation is slower (ratio `key`
    below 1) at it and at every larger one measured; None when it never is (or the
    largest measured is still faster). With speculation off from this batch size on,
    none of the batches that lost would speculate."""
    ratios = sorted((r["streams"], r[key]) for r in rows if r.get(key) is not None)
    threshold = None
    for streams, value in reversed(ratios):
        if value >= 1:
            break
        threshold = streams
    return threshold


def sweep_advice(found: int | None) -> str:
    """What the sweep says about `--speculative-disable-by-batch-size`."""
    if found is None:
        return (
            "suggested --speculative-disable-by-batch-size: none (speculating never cost "
            "throughput at full batch here)"
        )
    if found == 1:
        return "speculating cost throughput at every batch size measured, one stream too"
    return (
        f"suggested --speculative-disable-by-batch-size {found}: n-gram speculation was "
        f"slower at full batch from {found} streams on"
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    loaded = options.get_loaded(args.model)
    if loaded.tokenizer is None:
        raise InvalidParameterError("model", "bench spec-streams needs a model with a tokenizer")
    workloads = args.workloads or (["chat"] if args.sweep else list(WORKLOADS))
    counts = args.streams or (SWEEP_STREAMS if args.sweep else [1, 8, 64])
    per_stream = args.requests_per_stream
    for name, value in (("streams", min(counts)), ("requests_per_stream", per_stream)):
        check_int(value, name, min=1)
    off_opts, spec = spec_options(args)
    label = (
        f"ngram k={spec['num_speculative_tokens']} lookup "
        f"{spec['prompt_lookup_min']}..{spec['prompt_lookup_max']}"
    )
    if spec["speculative_disable_by_batch_size"] <= off_opts["max_num_seqs"]:
        label += f", off from batch {spec['speculative_disable_by_batch_size']}"
    rows = []
    for workload in workloads:
        for streams in counts:
            prompts = workload_prompts(
                loaded.tokenizer, workload, streams * args.requests_per_stream
            )
            base = None
            for mode, opts in (("off", off_opts), (label, off_opts | spec)):
                engine = build_engine(loaded, opts)[0]  # no other hold on its runner
                got = run_streams(engine, prompts, streams, args.max_tokens)
                row = run_row(workload, streams, mode, got, base)
                if base is None:
                    base, off_row = got, row
                else:
                    snap = engine.snapshot()
                    row["ratio"] = ratio(row["tokens_per_s"], off_row["tokens_per_s"])
                    row["full_batch_ratio"] = ratio(
                        row["full_batch_tokens_per_s"], off_row["full_batch_tokens_per_s"]
                    )
                    row["acceptance_rate"] = round(snap.spec_acceptance_rate, 3)
                    row["mean_accepted_length"] = round(snap.spec_mean_accepted_length, 2)
                engine.shutdown()
                del engine  # its KV pool goes before the next one is allocated
                rows.append(row)
                print(
                    f"  {workload} x{streams} {mode}: {row['tokens_per_s']} tok/s",
                    flush=True,
                )
    config = dict(
        workloads=workloads,
        streams=counts,
        max_tokens=args.max_tokens,
        requests_per_stream=args.requests_per_stream,
        eos="honoured",
        **{k: v for k, v in spec.items() if k != "speculative_method"},
    )
    notes = [
        "greedy, EOS honoured (natural stops), at most --max-tokens per request; a stream "
        "whose request ends takes the next prompt before the next step",
        "copy: repeat / rewrite / summarize a paragraph of bench/data/quality_text.txt; chat: "
        "the questions of bench/data/quality_prompts.txt; prompts cycle when more are needed",
        "tokens/s: generated tokens over the whole run (its tail runs fewer streams); full "
        "batch: over the steps that ran every stream, the figure the sweep compares",
        "same tokens as off: every request's tokens equal those without speculation",
    ]
    result = options.new_result("spec-streams", args, loaded, config, rows, notes)
    spec_rows = [r for r in rows if r["mode"] != "off"]
    result["summary"] = {"same_tokens": all(r["same_tokens"] for r in spec_rows)}
    for workload in workloads:
        mine = [r for r in spec_rows if r["workload"] == workload]
        result["summary"][f"{workload}_acceptance_rate"] = round(
            sum(r["acceptance_rate"] for r in mine) / len(mine), 3
        )
        if args.sweep or len(counts) > 1:
            threshold = disable_threshold(mine)
            result["summary"][f"{workload}_slower_from_streams"] = threshold
    if args.sweep:
        result["notes"].append(sweep_advice(result["summary"].get("chat_slower_from_streams")))
    result["exit_code"] = 0 if result["summary"]["same_tokens"] else 1
    plots = [
        Plot(
            f"ratio_{workload}",
            f"n-gram vs no speculation, {workload} workload",
            "streams",
            "tokens/s ratio (full batch)",
            {
                label: (
                    [r["streams"] for r in spec_rows if r["workload"] == workload],
                    [r["full_batch_ratio"] for r in spec_rows if r["workload"] == workload],
                )
            },
            log2_x=True,
        )
        for workload in workloads
    ]
    return write_outputs(result, args.out, COLUMNS, plots)
