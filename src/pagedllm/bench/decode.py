"""`pagedllm bench decode`: the decode step, the engine's hot path, at several batch sizes.

pagedllm's `LLMEngine.step()` with B sequences decoding (prompts already prefilled) next
to one transformers forward of the same model on a static batch of B with its KV cache,
in the same process: median milliseconds per step and tokens/s, and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from pagedllm.bench.common import base_result, get_loaded
from pagedllm.bench.output import write_outputs
from pagedllm.entrypoints.llm import LLM
from pagedllm.loader import LoadedModel
from pagedllm.sampling_params import SamplingParams

COLUMNS = [
    ("batch", "batch"),
    ("pagedllm_ms", "pagedllm ms/step"),
    ("hf_ms", "transformers ms/step"),
    ("pagedllm_tok_s", "pagedllm tok/s"),
    ("hf_tok_s", "transformers tok/s"),
    ("speedup", "speedup"),
]


def add_parser(sub: Any) -> None:
    p = sub.add_parser("decode", help="decode step time vs transformers at several batch sizes")
    p.add_argument("--model", default=None, help="a .gguf file or HF directory (default SmolLM2)")
    p.add_argument("--out", default="bench-out/decode")
    p.add_argument("--batch-sizes", default="1,64")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=16, help="decode steps timed per batch size")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def _prompts(loaded: LoadedModel, batch: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, loaded.config.vocab_size, (batch, length), generator=g).tolist()


def time_pagedllm(llm: LLM, prompts: list[list[int]], steps: int) -> float:
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"d{i}", p, params)
    started: set[str] = set()
    while len(started) < len(prompts):  # prefill (maybe in chunks) until all are decoding
        started.update(out.request_id for out in engine.step())
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(times)


@torch.inference_mode()
def time_hf(model: Any, prompts: list[list[int]], steps: int) -> float:
    from transformers import DynamicCache

    ids = torch.tensor(prompts)
    cache = DynamicCache()
    out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        out = model(input_ids=token, past_key_values=cache, use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(args: argparse.Namespace) -> dict[str, Any]:
    loaded = get_loaded(args.model)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    llm = LLM(loaded=loaded, max_num_seqs=max(batches), kv_cache_memory="2GiB")
    hf = None
    if not args.no_hf:
        from transformers import AutoModelForCausalLM

        if loaded.gguf_file:
            hf = AutoModelForCausalLM.from_pretrained(
                loaded.hf_dir, gguf_file=loaded.gguf_file, dtype=torch.float32
            )
        else:
            hf = AutoModelForCausalLM.from_pretrained(loaded.hf_dir, dtype=torch.float32)
        hf.eval()
    rows = []
    for batch in batches:
        prompts = _prompts(loaded, batch, args.prompt_len, args.seed)
        ours = time_pagedllm(llm, prompts, args.steps)
        theirs = time_hf(hf, prompts, args.steps) if hf is not None else None
        rows.append(
            {
                "batch": batch,
                "pagedllm_ms": round(ours * 1000, 1),
                "hf_ms": round(theirs * 1000, 1) if theirs else None,
                "pagedllm_tok_s": round(batch / ours, 1),
                "hf_tok_s": round(batch / theirs, 1) if theirs else None,
                "speedup": round(theirs / ours, 2) if theirs else None,
            }
        )
    result = base_result("decode", args, loaded, None, None)
    result["config"].update(
        prompt_len=args.prompt_len, steps=args.steps, threads=torch.get_num_threads()
    )
    result["results"] = rows
    result["notes"] += [
        "median of the timed decode steps, after the prompts are prefilled; pagedllm's step "
        "includes scheduling, the paged forward, sampling and output processing; "
        "transformers' is one forward with its DynamicCache plus an argmax",
    ]
    return write_outputs(result, args.out, COLUMNS)
