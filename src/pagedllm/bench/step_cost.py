"""`pagedllm bench step-cost`: the engine's own cost of a decode step, without a model.

`LLMEngine.step()` over FakeModelRunner (no model, no tokenizer) with N streams decoding,
at each prompt length: every request is queued at once, prefilled, and only the steady
decode steps after every prompt is in are timed. What remains is the engine's Python per
step (scheduling, bookkeeping, outputs), and how it grows with the context: the ratio of
the longest context's step to the shortest's says whether anything per step costs in
proportion to the prompt (the aim: at most 1.2x). Each output kind runs apart
(`--output-kinds`): what the engine builds per step differs (everything so far, only the
new tokens, or nothing until a request ends). With `--penalties` every request carries
repetition, frequency and presence penalties, whose rows must not carry the context.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from pagedllm.bench import options
from pagedllm.bench.output import ratio, write_outputs
from pagedllm.engine.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from pagedllm.worker.fake_runner import FakeModelRunner
from pagedllm.worker.runner import ModelSpec

VOCAB = 32000
BLOCK_SIZE = 16
KINDS = [k.name.lower() for k in RequestOutputKind]
COLUMNS = "output_kind=output kind|prompt_len=prompt tokens|streams=streams|ms_per_step=ms/step|"
COLUMNS += "vs_shortest=vs shortest|fastest_ms=fastest step ms"


def add_parser(sub: Any) -> None:
    p = sub.add_parser("step-cost", help="the engine's own time per decode step, by context")
    options.add_bench_args(p, "step-cost", run)
    p.add_argument("--streams", type=int, default=64, help="requests decoding at once")
    p.add_argument(
        "--prompt-lens", type=options.int_list, default="200,4096", help="default: 200,4096"
    )
    p.add_argument("--steps", type=int, default=200, help="decode steps timed per prompt length")
    p.add_argument(
        "--output-kinds",
        type=options.choice_list(KINDS, "output kind"),
        default=",".join(KINDS),
        help=f"the requests' output kinds, one run each (default: {','.join(KINDS)})",
    )
    p.add_argument(
        "--penalties",
        action="store_true",
        help="requests with repetition, frequency and presence penalties",
    )


def step_seconds(
    streams: int,
    prompt_len: int,
    steps: int,
    seed: int,
    kind: RequestOutputKind,
    penalties: bool = False,
) -> list[float]:
    """The wall time of each of `steps` decode steps of `streams` requests of
    `prompt_len` random tokens and output kind `kind` (with `penalties`: repetition,
    frequency and presence penalties), timed once every request decodes."""
    warmup = 2  # steps after the prefill, before the timed ones
    batched = max(2048, streams)
    # The first requests decode while the last ones prefill: their tokens count too.
    prefill_steps = -(-streams * prompt_len // (batched - streams)) + 1
    max_tokens = prefill_steps + warmup + steps + 1
    max_len = prompt_len + max_tokens
    config = EngineConfig(
        block_size=BLOCK_SIZE,
        num_kv_blocks=streams * -(-max_len // BLOCK_SIZE) + 1,
        max_num_seqs=streams,
        max_num_batched_tokens=batched,
        watermark=0.0,
    )
    engine = LLMEngine(config, runner=FakeModelRunner(ModelSpec(VOCAB, max_len), token=1))
    rng = random.Random(seed)
    penalised = {"repetition_penalty": 1.1, "frequency_penalty": 0.1, "presence_penalty": 0.1}
    params = SamplingParams(
        max_tokens=max_tokens,
        ignore_eos=True,
        output_kind=kind,
        **(penalised if penalties else {}),
    )
    for i in range(streams):
        engine.add_request(f"s{i}", [rng.randrange(100, VOCAB) for _ in range(prompt_len)], params)

    def decoding() -> int:  # the requests past their prompt
        return sum(t.num_tokens > prompt_len for t in engine.snapshot(tables=True).tables)

    while decoding() < streams:  # prefill, in chunks
        engine.step()
    for _ in range(warmup):
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    if engine.snapshot().num_running != streams:
        raise RuntimeError("a stream ended during the timed steps")  # the sizes above are wrong
    return times


def run(args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    for name in args.output_kinds:
        kind = RequestOutputKind[name.upper()]
        times = {
            n: step_seconds(args.streams, n, args.steps, args.seed, kind, args.penalties)
            for n in args.prompt_lens
        }
        ms = {n: 1000 * statistics.median(t) for n, t in times.items()}
        shortest = ms[args.prompt_lens[0]]
        rows += [
            {"output_kind": name, "prompt_len": n, "streams": args.streams}
            | {"ms_per_step": round(m, 3), "vs_shortest": ratio(m, shortest)}
            | {"fastest_ms": round(1000 * min(times[n]), 3)}
            for n, m in ms.items()
        ]
    config = {"streams": args.streams, "steps": args.steps, "block_size": BLOCK_SIZE}
    config["penalties"] = args.penalties
    notes = [
        "LLMEngine.step() over FakeModelRunner (no model, no tokenizer): the engine's own "
        "Python per step; median of the timed decode steps, after every prompt is in",
        "vs shortest: ms/step over the first prompt length's, per output kind (the aim: at "
        "most 1.2); fastest step: the least a step took, less swayed by other work on the "
        "cores than the median",
    ]
    result = options.new_result("step-cost", args, "none (fake model runner)", config, rows, notes)
    longest = args.prompt_lens[-1]
    for row in rows:
        if row["prompt_len"] == longest:
            result["ratios"][f"{row['output_kind']}_longest_vs_shortest"] = row["vs_shortest"]
    return write_outputs(result, args.out, COLUMNS)
