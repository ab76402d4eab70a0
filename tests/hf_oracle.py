"""Tiny random Llama-family models saved with `save_pretrained`, and the transformers
oracle for them: what tests import to build a model and check the engine against it."""

from __future__ import annotations

from pathlib import Path

import torch

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=512,
)


def make_tiny_model(path: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**{**TINY, **overrides}))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**{**TINY, **overrides}))
    else:
        raise ValueError(arch)
    # Random init leaves biases at zero; make Qwen2's q/k/v biases matter.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    return path


def load_hf(path: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation, EOS ignored."""
    ids = torch.tensor([prompt_ids])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),  # else a token equal to pad_token_id is masked
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
    )
    return out[0, len(prompt_ids) :].tolist()
