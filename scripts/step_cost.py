"""The engine's time per decode step, without a model and with the default one.

* `fake`: 64 streams decoding over FakeModelRunner at 200- and 4096-token contexts: the
  step's bookkeeping alone (scheduling, the block tables sent to the runner and kept
  there, sample rows, outputs), which the model's time hides;
* `real`: the default model (quantization none), decode steps at batch 1 and 8 from
  128-token prompts.

Each figure: the median of the timed steps, once every stream is decoding.

    .venv/bin/python scripts/step_cost.py fake
    .venv/bin/python scripts/step_cost.py real
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from pagedllm.engine.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.fake_runner import FakeModelRunner
from pagedllm.worker.runner import ModelSpec

BLOCK_SIZE = 16


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


def fake(steps: int) -> None:
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
        engine = LLMEngine(config, runner=FakeModelRunner(ModelSpec(32000, 65536, (0,)), token=1))
        ms = decode_step_ms(engine, streams, context, steps)
        print(f"fake runner, {streams} streams, context {context}: {ms:.3f} ms/step")


def real(steps: int) -> None:
    engine = LLMEngine(EngineConfig(quantization="none", max_num_seqs=8))
    for batch in (1, 8):
        ms = decode_step_ms(engine, batch, 128, steps)
        print(f"default model, quantization none, batch {batch}: {ms:.2f} ms/step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=["fake", "real"])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    (fake if args.what == "fake" else real)(args.steps)


if __name__ == "__main__":
    main()
