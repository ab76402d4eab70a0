"""The Hugging Face transformers baseline: `generate` in static, left-padded batches.

A static batch starts together and runs until its longest member is done; its KV cache
is one padded rectangle [batch, longest prompt + longest output]. Batches are packed in
request order while that rectangle fits the same KV token budget the engine gets. That
packing knows every output length (like `reserve-oracle`), which favours transformers.
Only the tokens each request asked for count as generated; the rest is padding work.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Sequence
from typing import Any

import torch

from pagedllm.bench.workload import BenchRequest
from pagedllm.loader import LoadedModel


def pack_static_batches(
    requests: Sequence[BenchRequest], kv_tokens: int, max_batch: int
) -> list[list[BenchRequest]]:
    """Consecutive batches whose padded KV rectangle fits `kv_tokens` (at least one each)."""
    batches: list[list[BenchRequest]] = []
    cur: list[BenchRequest] = []
    for r in requests:
        trial = [*cur, r]
        rect = len(trial) * (max(x.prompt_len for x in trial) + max(x.output_len for x in trial))
        if cur and (rect > kv_tokens or len(trial) > max_batch):
            batches.append(cur)
            trial = [r]
        cur = trial
    if cur:
        batches.append(cur)
    return batches


def padded_utilization(batch: Sequence[BenchRequest]) -> float:
    """Real tokens / slots of the padded cache, averaged over the batch's decode steps."""
    lp = max(r.prompt_len for r in batch)
    steps = max(r.output_len for r in batch)
    total = 0.0
    for j in range(1, steps + 1):
        real = sum(r.prompt_len + min(j, r.output_len) for r in batch)
        total += real / (len(batch) * (lp + j))
    return total / steps


def load_hf_model(loaded: LoadedModel) -> Any:
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"dtype": torch.float32}
    if loaded.gguf_file:
        kwargs["gguf_file"] = loaded.gguf_file
    model = AutoModelForCausalLM.from_pretrained(loaded.hf_dir, **kwargs).eval()
    model.generation_config.eos_token_id = None
    return model


@torch.inference_mode()
def _generate(model: Any, batch: Sequence[BenchRequest]) -> int:
    lp = max(r.prompt_len for r in batch)
    steps = max(r.output_len for r in batch)
    ids = torch.zeros((len(batch), lp), dtype=torch.long)
    mask = torch.zeros((len(batch), lp), dtype=torch.long)
    for i, r in enumerate(batch):  # left padding
        ids[i, lp - r.prompt_len :] = torch.tensor(r.prompt_token_ids)
        mask[i, lp - r.prompt_len :] = 1
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=steps,
        min_new_tokens=steps,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
    )
    return int(out.shape[1] - lp)


def run_hf(
    loaded: LoadedModel, requests: Sequence[BenchRequest], kv_tokens: int, max_batch: int
) -> dict[str, Any]:
    load_start = time.perf_counter()
    model = load_hf_model(loaded)
    load_s = time.perf_counter() - load_start
    _generate(model, [BenchRequest((1, 2, 3, 4), 2)])  # warm-up
    batches = pack_static_batches(requests, kv_tokens, max_batch)
    start = time.perf_counter()
    steps = weighted_batch = computed = 0
    util_sum = 0.0
    for batch in batches:
        n = _generate(model, batch)
        steps += n
        weighted_batch += n * len(batch)
        computed += n * len(batch)
        util_sum += padded_utilization(batch) * n
    elapsed = time.perf_counter() - start
    generated = sum(r.output_len for r in requests)
    del model
    gc.collect()
    return {
        "system": "hf",
        "requests": len(requests),
        "generated_tokens": generated,
        "seconds": round(elapsed, 3),
        "requests_per_s": round(len(requests) / elapsed, 3),
        "generated_tokens_per_s": round(generated / elapsed, 2),
        "preemptions": 0,
        "steps": steps,
        "mean_running_seqs": round(weighted_batch / max(steps, 1), 2),
        "peak_running_seqs": max(len(b) for b in batches),
        "kv_utilization": round(util_sum / max(steps, 1), 4),
        "num_batches": len(batches),
        "padding_tokens_computed": computed - generated,
        "model_load_s": round(load_s, 1),
    }
