"""External baselines for `bench throughput`, in the same process on the same requests:
Hugging Face transformers `generate`, and llama.cpp where `llama-cpp-python` is installed.

transformers runs static, left-padded batches, each packed in request order while its
padded KV rectangle [batch, longest prompt + longest output] fits the engine's KV budget:
it knows every output length (like `reserve-oracle`), which favours it. llama.cpp's
Python binding serves one request at a time.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from pagedllm.bench.options import kv_budget_tokens
from pagedllm.bench.workload import BenchRequest
from pagedllm.loader import LoadedModel

Requests = Sequence[BenchRequest]


def pack_static_batches(requests: Requests, kv_tokens: int, max_batch: int) -> list[Requests]:
    """Consecutive batches whose padded KV rectangle fits `kv_tokens` (at least one each)."""
    batches: list[list[BenchRequest]] = [[]]
    for r in requests:
        trial = [*batches[-1], r]
        rect = len(trial) * (max(x.prompt_len for x in trial) + max(x.output_len for x in trial))
        if batches[-1] and (rect > kv_tokens or len(trial) > max_batch):
            batches.append([])
        batches[-1].append(r)
    return [b for b in batches if b]


def padded_utilization(batch: Sequence[BenchRequest]) -> float:
    """Real tokens / slots of the padded cache, averaged over the batch's decode steps."""
    lp, steps = max(r.prompt_len for r in batch), max(r.output_len for r in batch)
    real = [sum(r.prompt_len + min(j, r.output_len) for r in batch) for j in range(1, steps + 1)]
    return sum(n / (len(batch) * (lp + j)) for j, n in enumerate(real, 1)) / steps


def load_hf_model(loaded: LoadedModel) -> Any:
    from transformers import AutoModelForCausalLM

    gguf = {"gguf_file": loaded.gguf_file} if loaded.gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(loaded.hf_dir, dtype=torch.float32, **gguf)
    model.generation_config.eos_token_id = None
    return model.eval()


@torch.inference_mode()
def generate(model: Any, batch: Sequence[BenchRequest]) -> int:
    """One static batch to its longest output; the number of decode steps."""
    lp, steps = max(r.prompt_len for r in batch), max(r.output_len for r in batch)
    ids = torch.zeros((len(batch), lp), dtype=torch.long)
    mask = torch.zeros((len(batch), lp), dtype=torch.long)
    for i, r in enumerate(batch):  # left padding
        ids[i, lp - r.prompt_len :] = torch.tensor(r.prompt_token_ids)
        mask[i, lp - r.prompt_len :] = 1
    greedy = {"do_sample": False, "pad_token_id": 0, "eos_token_id": None, "max_new_tokens": steps}
    out = model.generate(ids, attention_mask=mask, min_new_tokens=steps, **greedy)
    return int(out.shape[1] - lp)


def _row(system: str, requests: Requests, seconds: float) -> dict[str, Any]:
    generated = sum(r.output_len for r in requests)
    row = {"system": system, "requests": len(requests), "generated_tokens": generated}
    row |= {"seconds": round(seconds, 3), "requests_per_s": round(len(requests) / seconds, 3)}
    return row | {"generated_tokens_per_s": round(generated / seconds, 2), "preemptions": 0}


def run_hf(loaded: LoadedModel, requests: Requests, opts: dict) -> dict[str, Any]:
    load_start = time.perf_counter()
    model = load_hf_model(loaded)
    load_s = time.perf_counter() - load_start
    generate(model, [BenchRequest((1, 2, 3, 4), 2)])  # warm-up
    kv_tokens = kv_budget_tokens(loaded, opts)
    batches = pack_static_batches(requests, kv_tokens, opts["max_num_seqs"])
    start, steps, seq_steps, util = time.perf_counter(), 0, 0, 0.0
    for batch in batches:
        n = generate(model, batch)
        steps, seq_steps = steps + n, seq_steps + n * len(batch)
        util += padded_utilization(batch) * n
    row = _row("hf", requests, time.perf_counter() - start)
    del model
    gc.collect()
    row |= {"steps": steps, "mean_running_seqs": round(seq_steps / steps, 2)}
    row |= {"peak_running_seqs": max(map(len, batches)), "kv_utilization": round(util / steps, 4)}
    row["padding_tokens_computed"] = seq_steps - row["generated_tokens"]
    row["note"] = "static left-padded batches packed to fit the same KV budget knowing every "
    row["note"] += "output length; its KV util counts padding slots"
    return row | {"num_batches": len(batches), "model_load_s": round(load_s, 1)}


def run_llama_cpp(loaded: LoadedModel, requests: Requests, opts: dict) -> dict[str, Any]:
    if importlib.util.find_spec("llama_cpp") is None:  # some machines have no wheel of it
        return {"note": "llama-cpp-python is not installed: skipped"}
    if not loaded.gguf_file:
        return {"note": "the model is not a GGUF file: skipped"}
    from llama_cpp import Llama  # type: ignore[import-not-found]

    path, threads = os.path.join(loaded.hf_dir, loaded.gguf_file), os.cpu_count()
    llm = Llama(model_path=path, n_ctx=opts["max_model_len"], n_threads=threads, verbose=False)
    start = time.perf_counter()
    for r in requests:  # exactly output_len tokens each: EOS is not checked
        llm.reset()
        for n, _token in enumerate(llm.generate(list(r.prompt_token_ids), temp=0.0), 1):
            if n >= r.output_len:
                break
    row = _row("llama-cpp", requests, time.perf_counter() - start)
    note = "one request at a time, as its Python binding serves them"
    return row | {"mean_running_seqs": 1.0, "peak_running_seqs": 1, "note": note}


Backend = Callable[[LoadedModel, Requests, dict], dict[str, Any]]
BACKENDS: dict[str, Backend] = {"hf": run_hf, "llama-cpp": run_llama_cpp}
