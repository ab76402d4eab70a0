"""pagedllm's side of `bench llamacpp`: one GGUF with `--quantization gguf`, in a process
of its own, so that its peak resident memory is its own.

`probe_pagedllm(...)` runs `python -m pagedllm.bench.gguf_probe MODEL ...` and returns its
figures: seconds from the start of engine construction (the memory check, the load, the
engine) until it is ready to generate (the token after a one-token prompt is out: lazily
loaded kernels count, a prompt's prefill does not), the same from the process's start,
the median decode step at batch 1 (as `bench decode` times it), the KV pool's bytes, the
bytes of weights a step reads, and the process's peak resident memory over all of it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from pagedllm.bench.measured_process import run_measured

PROMPT_LEN = 16


def probe_pagedllm(
    model: str, steps: int, threads: int, kv_cache_memory: str, timeout_s: float = 1800
) -> dict[str, Any]:
    """The figures above for the GGUF at `model`; {"error": why} if the process failed."""
    command = [sys.executable, "-m", "pagedllm.bench.gguf_probe", model, "--steps", str(steps)]
    command += ["--threads", str(threads), "--kv-cache-memory", kv_cache_memory]
    run = run_measured([*command, "--started-at", repr(time.time())], timeout_s)
    lines = run.stdout.strip().splitlines()
    if run.returncode != 0 or not lines:
        return {"error": run.failure("pagedllm")}
    return json.loads(lines[-1]) | {"peak_rss_bytes": run.peak_rss_bytes}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """In the probe's process: build the engine, generate, time it (see the docstring)."""
    import torch

    from pagedllm.bench.engine_benches import decode_step_seconds, random_prompts
    from pagedllm.bench.memory_floor import stored_weight_bytes_per_step
    from pagedllm.bench.sweep import engine_over_runner
    from pagedllm.engine.config import EngineConfig
    from pagedllm.engine.memory_check import check_memory, kv_pool_bytes
    from pagedllm.kernels.gguf_blocks import kernel_build
    from pagedllm.loader import load_model
    from pagedllm.loader.memory_estimate import read_model_header
    from pagedllm.sampling_params import SamplingParams

    torch.set_num_threads(args.threads)
    config = EngineConfig(
        model=args.model, quantization="gguf", kv_cache_memory=args.kv_cache_memory
    )
    start = time.perf_counter()
    check_memory(config)
    loaded = load_model(args.model, keep_quantized=True)
    engine, runner = engine_over_runner(config, loaded)
    built = time.perf_counter()
    prompts = random_prompts(loaded.config.vocab_size, 1, PROMPT_LEN, seed=0)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    engine.add_request("ready", prompts[0][:1], params)
    while engine.has_unfinished_requests():
        engine.step()
    ready, ready_wall = time.perf_counter(), time.time()
    step_s, _, _ = decode_step_seconds(engine, runner, prompts, args.steps)
    figures = {
        "engine_s": round(built - start, 3),
        "ready_s": round(ready - start, 3),
        "process_ready_s": round(ready_wall - args.started_at, 3),
        "ms_per_token": round(1000 * step_s, 3),
        "kv_pool_bytes": kv_pool_bytes(config, read_model_header(loaded.source)),
        "weight_bytes_per_step": stored_weight_bytes_per_step(loaded),
        "threads": torch.get_num_threads(),
        "gguf_kernel": kernel_build(),  # "vnni" or "avx2": PAGEDLLM_NO_VNNI=1 forces avx2
    }
    engine.shutdown()
    return figures


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("model", help="a .gguf file")
    p.add_argument("--steps", type=int, default=32, help="decode steps timed (median)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv-cache-memory", default="256MiB")
    p.add_argument("--started-at", type=float, default=time.time(), help="time.time() at spawn")
    print(json.dumps(measure(p.parse_args())), flush=True)


if __name__ == "__main__":
    main()
