"""Decode steps of the default model's engines, alternating step by step so that a shared
machine's drift hits all alike; medians per batch size. The engines: the GGUF dequantized
to float32 (`--quantization none`), `--quantization gguf` (the file's blocks kept, each
plain layers in one compiled call), and the same gguf engine with its layers run step by step
(what the compiled layer call replaced).
    .venv/bin/python scripts/gguf_decode_alternating.py [--batch-sizes 1,8] [--steps 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from pagedllm import SamplingParams
from pagedllm.engine.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.loader import load_model

PROMPT_LEN = 32


class StepByStep:
    """The gguf engine with its layers' compiled call set aside during its steps."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.model = engine.runner.model

    def step(self) -> None:
        fused, self.model.fused_gguf = self.model.fused_gguf, None
        try:
            self.engine.step()
        finally:
            self.model.fused_gguf = fused


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    dequantized, kept = load_model(), load_model(keep_quantized=True)
    gguf = LLMEngine(EngineConfig(quantization="gguf", kv_cache_memory="256MiB"), kept)
    step_by_step_engine = LLMEngine(
        EngineConfig(quantization="gguf", kv_cache_memory="256MiB"), kept
    )
    engines = {
        "float32": LLMEngine(
            EngineConfig(quantization="none", kv_cache_memory="256MiB"), dequantized
        ),
        "gguf": gguf,
        "gguf step by step": step_by_step_engine,
    }
    steppers = {name: e.step for name, e in engines.items()}
    steppers["gguf step by step"] = StepByStep(step_by_step_engine).step
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0, max_tokens=args.steps + 8, ignore_eos=True)
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        prompts = [rng.integers(10, 40000, size=PROMPT_LEN).tolist() for _ in range(batch)]
        for name, engine in engines.items():
            for i, prompt in enumerate(prompts):
                engine.add_request(f"{batch}-{i}", prompt, params)
            for _ in range(3):  # the prefill and the first decodes
                steppers[name]()
        times: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(args.steps):
            for name, step in steppers.items():
                start = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - start)
        for engine in engines.values():
            while engine.has_unfinished_requests():
                engine.step()
        ms = {name: 1000 * statistics.median(t) for name, t in times.items()}
        base = ms["float32"]
        cells = ", ".join(f"{name} {v:.1f} ms ({v / base:.2f}x)" for name, v in ms.items())
        print(f"batch {batch}: {cells}")


if __name__ == "__main__":
    main()
