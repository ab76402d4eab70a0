"""Tiny random models of every supported family saved with `save_pretrained`, and the
transformers oracle for them: what tests import to build a model and check the engine
against it."""

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


# Per family: the transformers classes (by name) and what its tiny config adds to TINY.
# The windowed ones use a window of 8 tokens, so that test prompts run well past it;
# Gemma 3 mixes windowed and full layers (every second one full) with its own rope bases.
FAMILIES: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16)),
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, sliding_window=12),
    ),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8)),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            head_dim=16,
            num_hidden_layers=4,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"] * 2,
            query_pre_attn_scalar=24,
            final_logit_softcapping=30.0,
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
        ),
    ),
}


def make_tiny_model(path: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    import transformers

    if arch not in FAMILIES:
        raise ValueError(arch)
    config_cls, model_cls, extra = FAMILIES[arch]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**{**TINY, **extra, **overrides})
    model = getattr(transformers, model_cls)(config)
    # Random init leaves biases at zero and norms at one (Gemma's at zero): make them
    # matter, so that a bias or norm applied wrongly shows in the logits.
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


def make_lora_adapter(
    base: Path,
    path: Path,
    seed: int = 0,
    r: int = 4,
    targets: tuple[str, ...] = ("q_proj", "v_proj"),
    alpha: int = 8,
    rslora: bool = False,
) -> Path:
    """A random PEFT LoRA adapter of the model at `base` (both of its matrices random, so
    that it changes the logits), saved with `save_pretrained` to `path`."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=list(targets),
        init_lora_weights=False,
        use_rslora=rslora,
        lora_dropout=0.0,
    )
    get_peft_model(load_hf(base), config).save_pretrained(path)
    return path


def load_hf_lora(base: Path, adapter: Path):
    """transformers + PEFT: the base at `base` under the adapter at `adapter` (the oracle)."""
    from peft import PeftModel

    return PeftModel.from_pretrained(load_hf(base), adapter).eval()
