"""Decode steps of `--quantization none` (the GGUF dequantized to float32) and of
`--quantization gguf` (the file's blocks kept: the default), on the default model,
alternating step by step so that a shared machine's drift hits both alike; medians per
batch size.
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    loaded = load_model()
    engines = {
        q: LLMEngine(EngineConfig(quantization=q, kv_cache_memory="256MiB"), loaded)
        for q in ("none", "gguf")
    }
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0, max_tokens=args.steps + 8, ignore_eos=True)
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        prompts = [rng.integers(10, 40000, size=PROMPT_LEN).tolist() for _ in range(batch)]
        for engine in engines.values():
            for i, prompt in enumerate(prompts):
                engine.add_request(f"{batch}-{i}", prompt, params)
            for _ in range(3):  # the prefill and the first decodes
                engine.step()
        times: dict[str, list[float]] = {q: [] for q in engines}
        for _ in range(args.steps):
            for q, engine in engines.items():
                start = time.perf_counter()
                engine.step()
                times[q].append(time.perf_counter() - start)
        for engine in engines.values():
            while engine.has_unfinished_requests():
                engine.step()
        ms = {q: 1000 * statistics.median(t) for q, t in times.items()}
        print(
            f"batch {batch}: none {ms['none']:.1f} ms/step, gguf {ms['gguf']:.1f} ms/step "
            f"(gguf / none {ms['gguf'] / ms['none']:.2f})"
        )


if __name__ == "__main__":
    main()
