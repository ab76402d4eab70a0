"""The engine on a CUDA device gives the same greedy tokens as on the CPU (skipped
without a GPU)."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_cuda_greedy_equals_cpu(tiny_llama_dir) -> None:
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (4, 19, 33)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    cpu = LLM(str(tiny_llama_dir), block_size=8).generate(prompts, params, use_tqdm=False)
    gpu_llm = LLM(str(tiny_llama_dir), block_size=8, device="cuda")
    gpu = gpu_llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in gpu] == [o.outputs[0].token_ids for o in cpu]
    kv = gpu_llm.engine.kv
    assert kv.allocator.num_free_blocks == kv.num_blocks


def test_cuda_seeded_sampling_is_reproducible(tiny_llama_dir) -> None:
    llm = LLM(str(tiny_llama_dir), device="cuda")
    params = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    a = llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False)[0]
    b = llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
