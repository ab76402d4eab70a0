"""What layer groups save on Gemma 3 270M's shapes: the arithmetic and a measured run.

`python -m pagedllm.bench.layer_groups` prints, for the model's 18 layers (5 of every 6
with a 512-token window; 1 KV head of 256), the KV bytes one 8k-token sequence holds with
the layer-group (hybrid) manager and with every layer allocated in full, computed from
the groups (kv/groups.py); then it runs the real engine's bookkeeping (a fake runner: no
weights) over the same KV budget with 8k-token requests, hybrid and not, and reports how
many sequences ran at once.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from pagedllm.engine.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.kv.groups import group_layers, kv_bytes_per_sequence
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.fake_runner import FakeModelRunner
from pagedllm.worker.runner import ModelSpec

# Gemma 3 270M (text): 18 layers, sliding_window 512 on 5 of every 6, 1 KV head of 256.
GEMMA3_270M_WINDOWS: tuple[int | None, ...] = ((512,) * 5 + (None,)) * 3
GEMMA3_270M_KV_HEADS, GEMMA3_270M_HEAD_DIM, GEMMA3_270M_CONTEXT = 1, 256, 32768


def layer_token_bytes(element_size: int) -> int:
    """K and V of one token in one layer."""
    return 2 * GEMMA3_270M_KV_HEADS * GEMMA3_270M_HEAD_DIM * element_size


def arithmetic(num_tokens: int, block_size: int, element_size: int) -> dict[str, Any]:
    """Bytes one sequence of `num_tokens` holds while it decodes, hybrid and full."""
    per = layer_token_bytes(element_size)
    layers = len(GEMMA3_270M_WINDOWS)
    hybrid = group_layers(GEMMA3_270M_WINDOWS, layers)
    full = group_layers(GEMMA3_270M_WINDOWS, layers, hybrid=False)
    h = kv_bytes_per_sequence(hybrid, num_tokens, block_size, per)
    f = kv_bytes_per_sequence(full, num_tokens, block_size, per)
    return {
        "groups": f"{len(hybrid)} groups of {len(hybrid[0].layers)} layers, windows "
        f"{[g.window for g in hybrid]}",
        "hybrid_bytes": h,
        "full_bytes": f,
        "full_over_hybrid": round(f / h, 2),
    }


def concurrent_sequences(
    hybrid: bool, budget: str, num_requests: int, prompt_len: int, output_len: int
) -> dict[str, Any]:
    """Run `num_requests` requests of `prompt_len` + `output_len` tokens over a KV budget
    of `budget` bytes (fp32 K/V) and count the sequences that ran at once."""
    spec = ModelSpec(
        vocab_size=262144,
        max_position_embeddings=GEMMA3_270M_CONTEXT,
        num_layers=len(GEMMA3_270M_WINDOWS),
        layer_windows=GEMMA3_270M_WINDOWS,
    )
    runner = FakeModelRunner(
        spec, token=1, kv_bytes_per_token=len(GEMMA3_270M_WINDOWS) * layer_token_bytes(4)
    )
    config = EngineConfig(
        kv_cache_memory=budget,
        max_model_len=prompt_len + output_len,
        disable_hybrid_kv_cache_manager=not hybrid,
    )
    engine = LLMEngine(config, runner=runner)
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    for i in range(num_requests):
        engine.add_request(str(i), [1 + i] * prompt_len, params)
    peak = steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        peak = max(peak, engine.snapshot().num_running_seqs)
    end = engine.snapshot()
    return {
        "hybrid": hybrid,
        "kv_blocks": end.usage.num_blocks,
        "peak_running_seqs": peak,
        "preemptions": end.num_preemptions,
        "steps": steps,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192, help="sequence length")
    p.add_argument("--budget", default="1GiB", help="KV cache memory of each run")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--output-len", type=int, default=64)
    args = p.parse_args()
    prompt = args.tokens - args.output_len
    out = {
        "per_sequence_bf16": arithmetic(args.tokens, 16, 2),
        "per_sequence_fp32": arithmetic(args.tokens, 16, 4),
        "runs": [
            concurrent_sequences(h, args.budget, args.requests, prompt, args.output_len)
            for h in (True, False)
        ],
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
