"""Hugging Face-named weights into the common decoder (model/llama.py).

Q/K/V and gate/up are fused into one matrix each. Where the checkpoint names a norm
differs by family: Llama's `post_attention_layernorm` is the norm before the MLP, while
Gemma 3 ("sandwich" norms) calls the norm of the attention output so and names the one
before the MLP `pre_feedforward_layernorm`. Gemma's (1 + w) norms get their offset added
to the weight here, so every norm computes w * x / rms(x). GGUF linear layers
(model/gguf_linear.py) take their parts' blocks as they are, unfused: no copy.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from pagedllm.model.gguf_linear import GGUFLinear, GGUFWeight


def layer_norm_names(sandwich: bool) -> dict[str, str]:
    """The decoder layer's norm attributes -> their checkpoint names (in a layer)."""
    if sandwich:
        return {
            "input_layernorm": "input_layernorm",
            "attn_out_norm": "post_attention_layernorm",
            "post_attention_layernorm": "pre_feedforward_layernorm",
            "mlp_out_norm": "post_feedforward_layernorm",
        }
    return {
        "input_layernorm": "input_layernorm",
        "post_attention_layernorm": "post_attention_layernorm",
    }


def _load_linear(layer: Any, parts: list[Any]) -> None:
    """Fill a linear layer with the row-stacked `parts`: float tensors copied into a dense
    layer, GGUF weights kept as they are by a GGUF layer."""
    if isinstance(layer, GGUFLinear):
        layer.load(parts)
        return
    if any(isinstance(p, GGUFWeight) for p in parts):
        raise ValueError("weights kept as GGUF blocks need the model's linear='gguf'")
    layer.weight.copy_(parts[0] if len(parts) == 1 else torch.cat(parts, dim=0))


def load_decoder_weights(model: Any, weights: Mapping[str, Any]) -> None:
    """Copy `weights` (Hugging Face names) into `model`, a LlamaForCausalLM (not imported:
    it imports this module); a missing weight is a ValueError."""
    cfg = model.config

    def take(name: str) -> torch.Tensor:
        if name not in weights:
            raise ValueError(f"weight {name!r} is missing from the checkpoint")
        return weights[name]

    def norm(name: str) -> torch.Tensor:
        return take(name) + cfg.norm_offset if cfg.norm_offset else take(name)

    with torch.no_grad():
        embed = take("model.embed_tokens.weight")
        if isinstance(model.lm_head, GGUFLinear):
            model.embed_tokens = embed
        else:
            model.embed_tokens.copy_(embed)
        model.norm.weight.copy_(norm("model.norm.weight"))
        if isinstance(model.lm_head, GGUFLinear) or not cfg.tie_word_embeddings:
            lm_head = embed if cfg.tie_word_embeddings else take("lm_head.weight")
            _load_linear(model.lm_head, [lm_head])
        for i, layer in enumerate(model.layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            for attr, name in layer_norm_names(cfg.sandwich_norms).items():
                getattr(layer, attr).weight.copy_(norm(p + name + ".weight"))
            if layer.q_norm is not None and layer.k_norm is not None:
                layer.q_norm.weight.copy_(norm(a + "q_norm.weight"))
                layer.k_norm.weight.copy_(norm(a + "k_norm.weight"))
            _load_linear(layer.qkv, [take(f"{a}{n}_proj.weight") for n in "qkv"])
            if layer.qkv.bias is not None:
                layer.qkv.bias.copy_(torch.cat([take(f"{a}{n}_proj.bias") for n in "qkv"], dim=0))
            _load_linear(layer.o_proj, [take(a + "o_proj.weight")])
            _load_linear(layer.gate_up, [take(p + f"mlp.{n}_proj.weight") for n in ("gate", "up")])
            _load_linear(layer.down, [take(p + "mlp.down_proj.weight")])


def split_fused_weights(
    weights: dict[str, torch.Tensor], num_layers: int, q_size: int, kv_size: int
) -> None:
    """Phi-3 checkpoints store q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj`:
    split them, in place, into the separate names every other family uses."""
    for i in range(num_layers):
        p = f"model.layers.{i}."
        qkv = weights.pop(p + "self_attn.qkv_proj.weight", None)
        if qkv is not None:
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=0)
            for name, part in zip("qkv", (q, k, v), strict=True):
                weights[f"{p}self_attn.{name}_proj.weight"] = part.contiguous()
        gate_up = weights.pop(p + "mlp.gate_up_proj.weight", None)
        if gate_up is not None:
            gate, up = gate_up.chunk(2, dim=0)
            weights[p + "mlp.gate_proj.weight"] = gate.contiguous()
            weights[p + "mlp.up_proj.weight"] = up.contiguous()
