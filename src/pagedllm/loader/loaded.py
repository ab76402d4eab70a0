"""`LoadedModel`, what every loader returns, and the check that its weights fit its config.

Weights use Hugging Face Llama names (`model.layers.{i}.self_attn.q_proj.weight`, ...) as
float32 CPU tensors, or, for a GGUF loaded with its blocks kept (`kept_quantized`), the
linear layers' and the embedding's as `GGUFWeight`s; `check_weights` turns a missing or
misshapen tensor into a ModelLoadError.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagedllm.errors import ModelLoadError
from pagedllm.model.config import ModelConfig
from pagedllm.model.gguf_linear import GGUFWeight
from pagedllm.model.weights import layer_norm_names

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True, eq=False)
class LoadedModel:
    """A model's config, weights and tokenizer, plus how to load the same thing in transformers."""

    config: ModelConfig
    weights: dict[str, torch.Tensor | GGUFWeight]
    tokenizer: PreTrainedTokenizerBase | None
    source: str
    hf_dir: str
    gguf_file: str | None = None
    kept_quantized: bool = False  # GGUF blocks kept (quantization="gguf"), not dequantized


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight the model reads, with its transformers shape ([out, in] for linears)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q_dim = config.num_attention_heads * config.head_dim
    kv_dim = config.num_key_value_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        for norm in layer_norm_names(config.sandwich_norms).values():
            shapes[f"{p}{norm}.weight"] = (hidden,)
        if config.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (config.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (config.head_dim,)
        shapes[p + "self_attn.q_proj.weight"] = (q_dim, hidden)
        shapes[p + "self_attn.k_proj.weight"] = (kv_dim, hidden)
        shapes[p + "self_attn.v_proj.weight"] = (kv_dim, hidden)
        shapes[p + "self_attn.o_proj.weight"] = (hidden, q_dim)
        if config.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q_dim,)
            shapes[p + "self_attn.k_proj.bias"] = (kv_dim,)
            shapes[p + "self_attn.v_proj.bias"] = (kv_dim,)
        shapes[p + "mlp.gate_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.up_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.down_proj.weight"] = (hidden, inter)
    return shapes


def check_weights(
    config: ModelConfig, weights: dict[str, torch.Tensor | GGUFWeight], source: str
) -> None:
    """Raise ModelLoadError unless every expected weight is present with the expected shape."""
    for name, shape in expected_shapes(config).items():
        tensor = weights.get(name)
        if tensor is None:
            raise ModelLoadError(f"{source}: checkpoint has no weight {name!r}")
        if tuple(tensor.shape) != shape:
            raise ModelLoadError(
                f"{source}: weight {name!r} has shape {tuple(tensor.shape)}, "
                f"expected {shape} from the model config"
            )
