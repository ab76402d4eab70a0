"""Three changes to a decode step around the model's products, measured against what
they replaced (docs/kernels.md, "The rest of a decode step"):

* the greedy pick: the compiled `greedy_logprobs` against torch's max + logsumexp, on
  random logits of SmolLM2's vocabulary, at 1 and 64 rows;
* the whole step of the default model, alternating every 5 steps in one engine between
  the former path (K/V written by two `index_copy_` calls before the attention kernel,
  greedy rows through torch, each layer step by step), the step-by-step layers with the
  kernel writing K/V and the compiled greedy pick, and the current path (with int8, each
  layer one compiled call: model/fused_layer.py), so that the machine's drift hits all
  alike.

    .venv/bin/python scripts/step_write_and_greedy.py [--quantization int8] [--batch 1]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from pagedllm.attention.cpu import CpuPagedAttention
from pagedllm.attention.reference import write_kv
from pagedllm.bench import options
from pagedllm.bench.sweep import engine_over_runner
from pagedllm.engine.config import EngineConfig
from pagedllm.kernels.cpu import load_cpu_ops
from pagedllm.sampling_params import SamplingParams

CURRENT_ATTENTION = CpuPagedAttention.__call__


def median_us(fn: Callable[[], Any], repeats: int = 50) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def torch_pick(logits: torch.Tensor) -> torch.Tensor:
    best, _ = logits.max(dim=-1)
    return best - torch.logsumexp(logits, dim=-1)


def greedy(ops: Any) -> None:
    for rows in (1, 64):
        logits = torch.randn(rows, 49152, generator=torch.Generator().manual_seed(rows)) * 5
        ours = median_us(lambda x=logits: ops.greedy_logprobs(x))
        theirs = median_us(lambda x=logits: torch_pick(x))
        print(f"greedy, {rows} rows: compiled {ours:.0f} us, torch {theirs:.0f} us")


def former_attention(
    self: CpuPagedAttention, query, key, value, k_cache, v_cache, plan, window=None
):
    """The path before the kernel wrote K/V: index_copy_ twice, then the kernel's own call
    given no new rows to write."""
    write_kv(key, value, k_cache, v_cache, plan.meta.slot_mapping)
    no_rows = replace(plan, meta=replace(plan.meta, slot_mapping=plan.meta.slot_mapping[:0]))
    return CURRENT_ATTENTION(self, query, key[:0], value[:0], k_cache, v_cache, no_rows, window)


def steps(quantization: str | None, batch: int, rounds: int) -> None:
    config = EngineConfig(
        quantization=quantization, kv_cache_memory="1GiB", max_num_seqs=max(8, batch)
    )
    engine, runner = engine_over_runner(config, options.get_loaded(None), False)
    current, kernels = CURRENT_ATTENTION, runner.sampler.kernels
    fusions = [layer.fused for layer in runner.model.layers]
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=10 * rounds + 20, ignore_eos=True)
    for i in range(batch):
        engine.add_request(
            f"r{i}", torch.randint(100, 49000, (128,), generator=gen).tolist(), params
        )
    for _ in range(5):
        engine.step()
    seconds: dict[str, list[float]] = {"former": [], "step by step": [], "current": []}
    try:
        for _ in range(rounds):
            for mode, times in seconds.items():
                CpuPagedAttention.__call__ = former_attention if mode == "former" else current
                runner.sampler.kernels = None if mode == "former" else kernels
                for layer, fused in zip(runner.model.layers, fusions, strict=True):
                    layer.fused = fused if mode == "current" else None
                for _ in range(5):
                    start = time.perf_counter()
                    engine.step()
                    times.append(time.perf_counter() - start)
    finally:
        CpuPagedAttention.__call__ = current
        for layer, fused in zip(runner.model.layers, fusions, strict=True):
            layer.fused = fused
    print(f"{quantization or 'fp32'}, batch {batch}, {5 * rounds} steps each:")
    for mode, times in seconds.items():
        print(f"  {mode}: median {statistics.median(times) * 1000:.1f} ms per step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quantization", choices=["int8"])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=40, help="alternations, 5 steps each")
    args = parser.parse_args()
    greedy(load_cpu_ops())
    steps(args.quantization, args.batch, args.rounds)


if __name__ == "__main__":
    main()
