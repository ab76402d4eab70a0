"""GGUF tensors back into Hugging Face weights: names, and what llama.cpp's converter changed.

The converter (`convert_hf_to_gguf.py`) renames every tensor (gguf-py's `MODEL_TENSORS`),
and for some families also rewrites it; `hf_tensors` undoes each change:
* llama/mistral (`LlamaModel` and its subclasses): Q and K rows permuted for llama.cpp's
  rotary layout; `unpermute_rows` restores the checkpoint's order;
* gemma3: every `*norm.weight` stored as 1 + w (llama.cpp's norms scale by w, Gemma's by
  1 + w); 1 is subtracted so the weights mean what the checkpoint's do (norm_offset adds it);
* phi3: Q/K/V fused in `attn_qkv`, gate and up fused (gate first) in `ffn_up`; both split.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np

from pagedllm.model.config import ModelConfig

# Architectures whose Q/K rows llama.cpp's converter permutes (LlamaModel and its subclasses).
PERMUTED_ARCHITECTURES = ("llama", "mistral")

TOP_LEVEL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3's four norms per layer (its `ffn_norm` is the norm before the MLP).
SANDWICH_NORM_NAMES = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
FUSED_NAMES = {"attn_qkv": "self_attn.qkv_proj"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_TOP_RE = re.compile(r"(\w+)\.(weight|bias)")


def hf_name(gguf_name: str, sandwich_norms: bool = False) -> str | None:
    """The Hugging Face name for a GGUF tensor name, or None if it has no counterpart
    (Phi-3's fused tensors map to their fused names, split by `hf_tensors`)."""
    if m := _LAYER_RE.fullmatch(gguf_name):
        layer, part, kind = m.groups()
        names = {**LAYER_NAMES, **FUSED_NAMES, **(SANDWICH_NORM_NAMES if sandwich_norms else {})}
        if not sandwich_norms and part in ("post_attention_norm", "post_ffw_norm"):
            return None
        sub = names.get(part)
        return None if sub is None else f"model.layers.{layer}.{sub}.{kind}"
    if m := _TOP_RE.fullmatch(gguf_name):
        top = TOP_LEVEL_NAMES.get(m.group(1))
        return None if top is None else f"{top}.{m.group(2)}"
    return None


def unpermute_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute` of Q/K rows (works for weights and biases)."""
    head_dim = weight.shape[0] // n_head
    w = weight.reshape(n_head, head_dim // 2, 2, *weight.shape[1:])
    return w.swapaxes(1, 2).reshape(weight.shape)


def hf_tensors(
    name: str, array: np.ndarray, config: ModelConfig
) -> Iterator[tuple[str, np.ndarray]]:
    """The Hugging Face weights held by one dequantized GGUF tensor, already `hf_name`d."""
    if config.architecture in PERMUTED_ARCHITECTURES:
        if ".self_attn.q_proj." in name:
            array = unpermute_rows(array, config.num_attention_heads)
        elif ".self_attn.k_proj." in name:
            array = unpermute_rows(array, config.num_key_value_heads)
    if config.norm_offset and name.endswith("norm.weight"):
        array = array - np.float32(config.norm_offset)
    prefix, _, kind = name.rpartition(".")
    if prefix.endswith(".self_attn.qkv_proj"):
        q_size = config.num_attention_heads * config.head_dim
        kv_size = config.num_key_value_heads * config.head_dim
        q, k, v = np.split(array, [q_size, q_size + kv_size])
        base = prefix.removesuffix("qkv_proj")
        yield from ((f"{base}{p}_proj.{kind}", t) for p, t in zip("qkv", (q, k, v), strict=True))
    elif prefix.endswith(".mlp.up_proj") and array.shape[0] == 2 * config.intermediate_size:
        gate, up = np.split(array, 2)
        yield prefix.replace("up_proj", "gate_proj") + "." + kind, gate
        yield name, up
    else:
        yield name, array
