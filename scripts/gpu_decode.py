"""Decode-step timing on CUDA for scripts/gpu_check.sh: SmolLM2-135M's shape with random
weights, batch 1 and 64, fp32 and bf16, through LLMEngine.step() (CUDA events)."""

from __future__ import annotations

import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pagedllm import LLM, SamplingParams

SMOLLM2 = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    tie_word_embeddings=True,
    rms_norm_eps=1e-5,
)


def main() -> None:
    path = tempfile.mkdtemp()
    LlamaForCausalLM(LlamaConfig(**SMOLLM2)).save_pretrained(path)
    print("| dtype | batch | ms/step | tok/s |\n|---|---|---|---|")
    for dtype in ("float32", "bfloat16"):
        llm = LLM(path, device="cuda", dtype=dtype, max_num_seqs=64, kv_cache_memory="4GiB")
        engine = llm.engine
        for batch in (1, 64):
            params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
            for i in range(batch):
                engine.add_request(f"{dtype}-{batch}-{i}", list(range(100, 228)), params)
            for _ in range(8):  # prefill and warm-up
                engine.step()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(20):
                engine.step()
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end) / 20
            print(f"| {dtype} | {batch} | {ms:.2f} | {batch / ms * 1000:.0f} |")
            while engine.has_unfinished_requests():
                engine.step()
            assert engine.kv.allocator.num_free_blocks == engine.kv.num_blocks


if __name__ == "__main__":
    main()
