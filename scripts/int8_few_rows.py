"""The int8 decode step of the default model at a few rows, with the AVX2 GEMM's panels
taking those rows (as the engine does without VNNI) and with the row-major gemv instead,
alternating in one engine so that the machine's drift hits both alike (docs/kernels.md);
the layers run step by step.
    .venv/bin/python scripts/int8_few_rows.py --batch 1 [--rounds 30]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedllm.bench import options
from pagedllm.bench.sweep import engine_over_runner
from pagedllm.engine.config import EngineConfig
from pagedllm.model.linear import Int8Linear
from pagedllm.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=30, help="alternations, 5 steps each")
    args = parser.parse_args()
    config = EngineConfig(quantization="int8", kv_cache_memory="1GiB", max_num_seqs=8)
    engine, runner = engine_over_runner(config, options.get_loaded(None), False)
    # Layer by layer (not one compiled call each, which gathers its panels once): each
    # Int8Linear then reads the panels (or not) as this script sets them.
    for decoder_layer in runner.model.layers:
        decoder_layer.fused = None
    layers = [m for m in runner.model.modules() if isinstance(m, Int8Linear)]
    panels = [layer.panels for layer in layers]
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=10 * args.rounds + 20, ignore_eos=True)
    for i in range(args.batch):
        prompt = torch.randint(100, 49000, (128,), generator=gen).tolist()
        engine.add_request(f"r{i}", prompt, params)
    for _ in range(10):
        engine.step()
    steps: dict[str, list[float]] = {"panels": [], "gemv": []}
    for _ in range(args.rounds):
        for mode, seconds in steps.items():
            for layer, packed in zip(layers, panels, strict=True):
                layer.panels = packed if mode == "panels" else None  # None: the gemv
            for _ in range(5):
                start = time.perf_counter()
                engine.step()
                seconds.append(time.perf_counter() - start)
    print(f"batch {args.batch}, {torch.get_num_threads()} threads, {5 * args.rounds} steps each:")
    for mode, seconds in steps.items():
        print(f"  {mode}: median {statistics.median(seconds) * 1000:.1f} ms per step")


if __name__ == "__main__":
    main()
