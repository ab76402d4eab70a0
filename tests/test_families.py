"""Qwen3, Phi-3, Gemma 3 (text) and Mistral with an attention window against transformers
(the oracle) on tiny random models: logits within 1e-4 over a prefill and 24 decode steps
through shuffled paged blocks of several sizes, and greedy tokens through the engine
(batched, chunked prefill, preemption). The windowed models (Mistral and Phi-3 over every
layer, Gemma 3 over every second one) have windows of 8 and 12 tokens, and the prompts
run well past them. Also: transformers' window convention, pinned."""

from __future__ import annotations

import pytest
import torch

from hf_oracle import hf_greedy, load_hf
from pagedllm import LLM, SamplingParams
from pagedllm.loader import load_model
from test_model_vs_hf import assert_logits_match

FAMILIES = ["qwen3", "phi3", "gemma3", "mistral"]
WINDOWED = ["phi3", "gemma3", "mistral"]
STEPS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def test_the_window_convention_is_transformers() -> None:
    """A query at position p sees the keys at (p - W, p]: W keys, its own included."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    for window in (1, 3, 8):
        visible = sliding_window_causal_mask_function(window)
        for p in range(20):
            for j in range(20):
                ours = p - window < j <= p
                seen = visible(0, 0, torch.tensor(p), torch.tensor(j))
                assert bool(seen) == ours, (window, p, j)


def test_the_configs_read_each_family(family_dir) -> None:
    configs = {arch: load_model(str(family_dir(arch))).config for arch in FAMILIES}
    assert configs["mistral"].layer_windows == (8, 8)
    assert configs["phi3"].layer_windows == (12, 12)
    assert configs["qwen3"].layer_windows is None and configs["qwen3"].qk_norm
    gemma = configs["gemma3"]
    assert gemma.layer_windows == (8, None, 8, None)
    assert (gemma.rope_theta, gemma.local_rope_theta) == (1_000_000.0, 10_000.0)
    assert gemma.uses_local_rope(0) and not gemma.uses_local_rope(1)
    assert gemma.sandwich_norms and gemma.qk_norm and gemma.norm_offset == 1.0
    assert gemma.mlp_activation == "gelu_tanh" and gemma.embedding_scale == 64**0.5
    assert gemma.attention_scale == 24**-0.5 and gemma.final_logit_softcapping == 30.0


@pytest.mark.parametrize("arch", FAMILIES)
@pytest.mark.parametrize("block_size", [1, 8, 16])
def test_logits_match_transformers(arch, block_size, family_dir) -> None:
    assert_logits_match(family_dir(arch), block_size, STEPS)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 128, (n,), generator=g).tolist() for n in (5, 17, 33, 1, 40, 9)]


@pytest.fixture(scope="module")
def oracle(family_dir, prompts):
    """transformers' greedy tokens per family, computed once."""
    cache: dict[str, list[list[int]]] = {}

    def get(arch: str) -> list[list[int]]:
        if arch not in cache:
            hf = load_hf(family_dir(arch))
            cache[arch] = [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]
        return cache[arch]

    return get


def generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    kv = llm.engine.kv
    assert kv.allocator.num_free_blocks == kv.num_blocks
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch", FAMILIES)
def test_batched_greedy_equals_transformers(arch, family_dir, prompts, oracle) -> None:
    llm = LLM(str(family_dir(arch)), block_size=8)
    assert generate(llm, prompts) == oracle(arch)


@pytest.mark.parametrize("arch", WINDOWED)
def test_chunked_prefill_keeps_windowed_outputs_exact(arch, family_dir, prompts, oracle) -> None:
    llm = LLM(str(family_dir(arch)), block_size=4, max_num_batched_tokens=6)
    assert generate(llm, prompts) == oracle(arch)


@pytest.mark.parametrize("arch", WINDOWED)
def test_preemption_keeps_windowed_outputs_exact(arch, family_dir, prompts, oracle) -> None:
    # Every layer allocated in full, so this pool preempts (test_hybrid_kv.py preempts
    # the layer-group manager, which holds only the windows' blocks, in smaller pools).
    llm = LLM(
        str(family_dir(arch)),
        block_size=4,
        num_kv_blocks=24,
        watermark=0.0,
        disable_hybrid_kv_cache_manager=True,
    )
    assert generate(llm, prompts) == oracle(arch)
    assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("arch", ["gemma3", "mistral"])
def test_the_reference_backend_generates_the_same(arch, family_dir, prompts, oracle) -> None:
    llm = LLM(str(family_dir(arch)), block_size=16, attention_backend="reference")
    assert generate(llm, prompts) == oracle(arch)
