"""`pagedllm bench step-cost`: the engine's own cost of a decode step, without a model.

`LLMEngine.step()` over FakeModelRunner (no model, no tokenizer) with N streams decoding,
at each prompt length: every request is queued at once, prefilled, and only the steady
decode steps after every prompt is in are timed. What remains is the engine's Python per
step (scheduling, bookkeeping, outputs), and how it grows with the context: the ratio of
the longest context's step to the shortest's says whether anything per step costs in
proportion to the prompt (the aim: at most 1.2x).
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
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.fake_runner import FakeModelRunner
from pagedllm.worker.runner import ModelSpec

VOCAB = 32000
BLOCK_SIZE = 16
COLUMNS = "prompt_len=prompt tokens|streams=streams|ms_per_step=ms/step|vs_shortest=vs shortest"


def add_parser(sub: Any) -> None:
    p = sub.add_parser("step-cost", help="the engine's own time per decode step, by context")
    options.add_bench_args(p, "step-cost", run)
    p.add_argument("--streams", type=int, default=64, help="requests decoding at once")
    p.add_argument(
        "--prompt-lens", type=options.int_list, default="200,4096", help="default: 200,4096"
    )
    p.add_argument("--steps", type=int, default=200, help="decode steps timed per prompt length")


def step_seconds(streams: int, prompt_len: int, steps: int, seed: int) -> list[float]:
    """The wall time of each of `steps` decode steps of `streams` requests of
    `prompt_len` random tokens, timed once every request has its first token."""
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
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for i in range(streams):
        engine.add_request(f"s{i}", [rng.randrange(100, VOCAB) for _ in range(prompt_len)], params)
    started: set[str] = set()
    while len(started) < streams:  # prefill (in chunks) until every request decodes
        started.update(out.request_id for out in engine.step())
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
    for prompt_len in args.prompt_lens:
        times = step_seconds(args.streams, prompt_len, args.steps, args.seed)
        ms = 1000 * statistics.median(times)
        rows.append({"prompt_len": prompt_len, "streams": args.streams, "ms_per_step": ms})
    shortest = rows[0]["ms_per_step"]
    for row in rows:
        row["vs_shortest"] = ratio(row["ms_per_step"], shortest)
        row["ms_per_step"] = round(row["ms_per_step"], 3)
    config = {"streams": args.streams, "steps": args.steps, "block_size": BLOCK_SIZE}
    notes = [
        "LLMEngine.step() over FakeModelRunner (no model, no tokenizer): the engine's own "
        "Python per step; median of the timed decode steps, after every prompt is in",
        "vs shortest: ms/step over the first prompt length's (the aim: at most 1.2)",
    ]
    result = options.new_result("step-cost", args, "none (fake model runner)", config, rows, notes)
    result["ratios"]["longest_vs_shortest"] = rows[-1]["vs_shortest"]
    return write_outputs(result, args.out, COLUMNS)
