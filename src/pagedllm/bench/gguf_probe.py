"""pagedllm's side of `bench llamacpp`: one GGUF with `--quantization gguf`, in a process
of its own, so that its peak resident memory is its own.

`probe_pagedllm(...)` runs `python -m pagedllm.bench.gguf_probe MODEL ...` and returns its
figures: seconds from the start of engine construction (the memory check, the load, the
engine) until it is ready to generate (the token after a one-token prompt is out: lazily
loaded kernels count, a prompt's prefill does not), the same from the process's start,
the median decode step at batch 1 (as `bench decode` times it), then (unless
`prompt_tokens` is 0) the median engine step that processes a prompt of that many random
token ids whole, the KV pool's bytes, the bytes of weights a step reads, and the process's
peak resident memory over all of it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import TYPE_CHECKING, Any

from pagedllm.bench.measured_process import run_measured

if TYPE_CHECKING:
    from pagedllm.engine.llm_engine import LLMEngine

PROMPT_LEN = 16
PROMPT_REPETITIONS = 5  # as llama-bench's default -r, after one warm-up prompt


def probe_pagedllm(
    model: str,
    steps: int,
    threads: int,
    kv_cache_memory: str,
    prompt_tokens: int = 0,
    timeout_s: float = 1800,
) -> dict[str, Any]:
    """The figures above for the GGUF at `model`; {"error": why} if the process failed,
    "prompt_error" in place of the prompt's figures if the engine refuses such a prompt."""
    command = [sys.executable, "-m", "pagedllm.bench.gguf_probe", model, "--steps", str(steps)]
    command += ["--threads", str(threads), "--kv-cache-memory", kv_cache_memory]
    command += ["--prompt-tokens", str(prompt_tokens)]
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
    # A token budget that takes the whole prompt in one step, as llama-bench's pp runs one
    # batch; decoding one stream never comes near either budget.
    budget = max(EngineConfig.max_num_batched_tokens, args.prompt_tokens)
    config = EngineConfig(
        model=args.model,
        quantization="gguf",
        kv_cache_memory=args.kv_cache_memory,
        max_num_batched_tokens=budget,
    )
    start = time.perf_counter()
    check_memory(config)
    loaded = load_model(args.model, keep_quantized=True)
    engine, runner = engine_over_runner(config, loaded)
    built = time.perf_counter()
    vocab_size, source = loaded.config.vocab_size, loaded.source
    weight_bytes = stored_weight_bytes_per_step(loaded)
    # The engine holds the weights it computes with; what else the loader returned (the Q/K
    # rows it permuted into copies, since interleaved) a serving process does not keep.
    del loaded
    prompts = random_prompts(vocab_size, 1, PROMPT_LEN, seed=0)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    engine.add_request("ready", prompts[0][:1], params)
    while engine.has_unfinished_requests():
        engine.step()
    ready, ready_wall = time.perf_counter(), time.time()
    step_s = decode_step_seconds(engine, runner, prompts, args.steps).median_s
    figures = {
        "engine_s": round(built - start, 3),
        "ready_s": round(ready - start, 3),
        "process_ready_s": round(ready_wall - args.started_at, 3),
        "ms_per_token": round(1000 * step_s, 3),
        "kv_pool_bytes": kv_pool_bytes(config, read_model_header(source)),
        "weight_bytes_per_step": weight_bytes,
        "threads": torch.get_num_threads(),
        "gguf_kernel": kernel_build(),  # "vnni" or "avx2": PAGEDLLM_NO_VNNI=1 forces avx2
    }
    if args.prompt_tokens > 0:
        figures |= prompt_figures(engine, vocab_size, args.prompt_tokens)
    engine.shutdown()
    return figures


def prompt_figures(engine: LLMEngine, vocab_size: int, length: int) -> dict[str, Any]:
    """The median seconds of the engine step that processes a `length`-token prompt whole
    and samples its first token, over PROMPT_REPETITIONS fresh requests after a warm-up.
    Each prompt is new random ids, so the prefix cache has none of it."""
    from pagedllm.bench.engine_benches import random_prompts
    from pagedllm.errors import InvalidParameterError
    from pagedllm.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    prompts = random_prompts(vocab_size, PROMPT_REPETITIONS + 1, length, seed=1)
    try:
        engine.check_request(prompts[0], params)
    except InvalidParameterError as exc:
        return {"prompt_error": f"a {length}-token prompt: {exc}"}
    times = []
    for i, prompt in enumerate(prompts):
        engine.add_request(f"prompt{i}", prompt, params)
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
        if engine.has_unfinished_requests():  # the budget above rules this out
            raise RuntimeError(f"a {length}-token prompt took more than one step")
    seconds = statistics.median(times[1:])
    return {
        "prompt_tokens": length,
        "prompt_ms": round(1000 * seconds, 3),
        "prompt_tok_s": round(length / seconds, 2),
        "prompt_repetitions_ms": [round(1000 * t, 2) for t in times[1:]],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("model", help="a .gguf file")
    p.add_argument("--steps", type=int, default=32, help="decode steps timed (median)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv-cache-memory", default="256MiB")
    p.add_argument("--prompt-tokens", type=int, default=0, help="prompt timed (0: none)")
    p.add_argument("--started-at", type=float, default=time.time(), help="time.time() at spawn")
    print(json.dumps(measure(p.parse_args())), flush=True)


if __name__ == "__main__":
    main()
