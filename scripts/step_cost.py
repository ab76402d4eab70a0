"""The model runner's side of a decode step, without a model and with the default one.

* `inputs`: 64 streams decoding at 200- and 4096-token contexts over FakeModelRunner
  made to build the real runner's inputs of each step as well (its persistent batch's
  block tables, worker/input_batch.py, and the step's AttentionMetadata): the engine's
  step time with the share of it in `schedule()` and in the runner, and the size of a
  step pickled (what tensor parallelism sends every rank). `pagedllm bench step-cost`
  times the step over the plain fake runner;
* `real`: the default model (quantization none), decode steps at batch 1 and 8 from
  128-token prompts.

Each figure: the median of the timed steps, once every stream is decoding. `--threads`
sets torch's threads (on a shared machine, 1 keeps the small host-side tensor work from
waiting on busy cores).

    .venv/bin/python scripts/step_cost.py inputs --threads 1
    .venv/bin/python scripts/step_cost.py real
"""

from __future__ import annotations

import argparse
import pickle
import random
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from pagedllm.attention.metadata import build_grouped_metadata
from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.engine.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.fake_runner import FakeModelRunner
from pagedllm.worker.runner import ModelSpec, SampledTokens, SampleRow

BLOCK_SIZE = 16


class Timed:
    """Wraps `obj.name` to keep the seconds each call takes, and its result."""

    def __init__(self, obj: Any, name: str) -> None:
        self.inner = getattr(obj, name)
        self.seconds: list[float] = []
        self.results: list[Any] = []
        setattr(obj, name, self)

    def __call__(self, *args: Any) -> Any:
        start = time.perf_counter()
        result = self.inner(*args)
        self.seconds.append(time.perf_counter() - start)
        self.results.append(result)
        return result

    def median_ms(self, last: int) -> float:
        return 1000 * statistics.median(self.seconds[-last:])


def decode_step_ms(engine: LLMEngine, streams: int, context: int, steps: int) -> float:
    """Median ms of `steps` decode steps of `streams` requests with `context`-token prompts."""
    rng = random.Random(0)
    params = SamplingParams(max_tokens=steps + 8, ignore_eos=True, temperature=0.0)
    for i in range(streams):
        engine.add_request(f"r{i}", [rng.randrange(1, 100) for _ in range(context)], params)
    while any(r.num_computed_tokens < r.num_tokens - 1 for r in engine.scheduler.requests.values()):
        engine.step()  # the prompts, in chunks
    engine.step()  # every stream's first token: from here on each step is a decode
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    for rid in list(engine.scheduler.requests):
        engine.abort(rid)
    return 1000 * statistics.median(times)


class InputsRunner(FakeModelRunner):
    """The fake runner, building the real runner's inputs of each step first."""

    def __init__(self) -> None:
        # Imported here: `real` runs on an engine from before the persistent batch too,
        # for before-and-after figures.
        from pagedllm.worker.input_batch import InputBatch

        super().__init__(ModelSpec(32000, 65536, (0,)), token=1)
        self.input_batch = InputBatch(1)

    def execute(self, step: SchedulerOutput, rows: Sequence[SampleRow]) -> SampledTokens:
        seqs = step.seqs
        build_grouped_metadata(
            [s.start_pos for s in seqs],
            [len(s.token_ids) for s in seqs],
            self.input_batch.step_tables(step),
            [i for i, s in enumerate(seqs) if s.needs_logits],
            BLOCK_SIZE,
            (0,),
        )
        return super().execute(step, rows)


def inputs(steps: int) -> None:
    """64 streams at 200- and 4096-token contexts over InputsRunner."""
    streams = 64
    for context in (200, 4096):
        blocks = streams * -(-(context + steps + 16) // BLOCK_SIZE) + 64
        config = EngineConfig(
            block_size=BLOCK_SIZE,
            num_kv_blocks=blocks,
            max_num_seqs=streams,
            max_num_batched_tokens=8192,
            max_model_len=context + steps + 16,
            enable_prefix_caching=False,
        )
        engine = LLMEngine(config, runner=InputsRunner())
        schedule, execute = Timed(engine.scheduler, "schedule"), Timed(engine.runner, "execute")
        ms = decode_step_ms(engine, streams, context, steps)
        first_decode = schedule.results[-steps]  # every stream decodes in it
        print(
            f"{streams} streams, "
            f"context {context}: {ms:.3f} ms/step "
            f"(schedule {schedule.median_ms(steps):.3f}, runner {execute.median_ms(steps):.3f}); "
            f"a decode step of {len(first_decode.seqs)} sequences pickled: "
            f"{len(pickle.dumps(first_decode))} bytes"
        )


def real(steps: int) -> None:
    engine = LLMEngine(EngineConfig(quantization="none", max_num_seqs=8))
    for batch in (1, 8):
        ms = decode_step_ms(engine, batch, 128, steps)
        print(f"default model, quantization none, batch {batch}: {ms:.2f} ms/step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=["inputs", "real"])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    (real if args.what == "real" else inputs)(args.steps)


if __name__ == "__main__":
    main()
