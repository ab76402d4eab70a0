"""One stream's decode steps on a GGUF file with the CPU attention's decode rows cut into
ranges of their KV heads (the plan's rule, kernels/policy.py `decode_head_splits`) and
with every row whole (the rule before it), alternating every two steps in one engine so
that a shared machine's drift hits both alike; the median step of each.
    .venv/bin/python scripts/attention_head_ranges.py MODEL.gguf [--context 400] [--steps 80]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import pagedllm.attention.cpu_plan as cpu_plan
from pagedllm.bench.engine_benches import random_prompts
from pagedllm.bench.sweep import engine_over_runner
from pagedllm.engine.config import EngineConfig
from pagedllm.loader import load_model
from pagedllm.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model")
    parser.add_argument("--context", type=int, default=400, help="prompt tokens before decoding")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = EngineConfig(
        model=args.model,
        quantization="gguf",
        kv_cache_memory="256MiB",
        max_num_batched_tokens=max(EngineConfig.max_num_batched_tokens, args.context),
    )
    loaded = load_model(args.model, keep_quantized=True)
    engine, _ = engine_over_runner(config, loaded)
    prompt = random_prompts(loaded.config.vocab_size, 1, args.context, seed=0)[0]
    params = SamplingParams(temperature=0, max_tokens=args.steps + 4, ignore_eos=True)
    engine.add_request("r", prompt, params)
    for _ in range(3):  # the prompt, then warm-up steps
        engine.step()
    rule = cpu_plan.decode_head_splits
    times: dict[str, list[float]] = {"head ranges": [], "whole rows": []}
    for i in range(args.steps):
        name = "head ranges" if (i // 2) % 2 else "whole rows"
        cpu_plan.decode_head_splits = rule if name == "head ranges" else (lambda *_: 1)
        start = time.perf_counter()
        engine.step()
        times[name].append(time.perf_counter() - start)
    cpu_plan.decode_head_splits = rule
    last = args.context + args.steps
    for name, seconds in times.items():
        print(
            f"{name}: median {1e3 * statistics.median(seconds):.2f} ms a step, context "
            f"{args.context}-{last}"
        )


if __name__ == "__main__":
    main()
