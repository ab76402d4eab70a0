"""Write a tiny Hugging Face model (hf_oracle.make_tiny_model) as a GGUF file the way
llama.cpp's `convert_hf_to_gguf.py` does, so tests can check that loading the GGUF gives
back the original model.

What the converter does per family (and this mimics): every tensor renamed to gguf-py's
names; llama/mistral (`LlamaModel`) Q/K rows permuted; Gemma 3 norms written as 1 + w, its
`pre_feedforward_layernorm` as `ffn_norm` and `post_attention_layernorm` as
`post_attention_norm`; Phi-3's fused `qkv_proj` as `attn_qkv` and `gate_up_proj` as
`ffn_up`. Metadata: the `{arch}.*` keys each converter writes (`sliding_window` for
Mistral, Phi-3 and Gemma 3; Gemma 3's pattern and local rope base are left to the reader).
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

GGUF_ARCH = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "phi3": "phi3",
    "gemma3_text": "gemma3",
}
LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
POST_ATTENTION = {False: "ffn_norm", True: "post_attention_norm"}  # by sandwich norms
GEMMA_NORMS = {
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py `LlamaModel.permute` (n_head already the kv count for K)."""
    rows = w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
    return rows.swapaxes(1, 2).reshape(w.shape)


def gguf_tensor_name(hf: str, sandwich: bool) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    names = {**LAYER, "post_attention_layernorm": POST_ATTENTION[sandwich], **GEMMA_NORMS}
    return f"blk.{layer}.{names[module]}.{kind}"


def _add_metadata(writer: gguf.GGUFWriter, arch: str, cfg: dict) -> None:
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(cfg.get("num_key_value_heads") or heads)
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    params = cfg.get("rope_parameters") or {}
    full = params.get("full_attention", params)
    writer.add_rope_freq_base(full.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if arch in ("mistral", "phi3", "gemma3") and cfg.get("sliding_window"):
        writer.add_sliding_window(cfg["sliding_window"])
    if arch == "gemma3" and cfg.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    for key, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", None)):
        if cfg.get(key) is not None:
            (add or writer.add_eos_token_id)(cfg[key])


def write_gguf(hf_dir: Path, path: Path, kind: str = "F32") -> Path:
    """The GGUF of the tiny model in `hf_dir` (tensors of two dims in `kind`: F32, F16 or
    a block type gguf.quants quantizes, e.g. Q8_0)."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = GGUF_ARCH[cfg["model_type"]]
    sandwich = arch == "gemma3"
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads")
    writer = gguf.GGUFWriter(str(path), arch)
    _add_metadata(writer, arch, cfg)
    for hf, w in sorted(load_file(str(hf_dir / "model.safetensors")).items()):
        w = w.astype(np.float32)
        if hf == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        if arch in ("llama", "mistral") and ".q_proj." in hf:
            w = llama_cpp_permute(w, heads)
        elif arch in ("llama", "mistral") and ".k_proj." in hf:
            w = llama_cpp_permute(w, kv_heads or heads)
        if sandwich and hf.endswith("norm.weight"):
            w = w + 1  # Gemma3RMSNorm scales by 1 + w; llama.cpp's norms by w
        name = gguf_tensor_name(hf, sandwich)
        if w.ndim == 2 and kind not in ("F32", "F16"):
            blocks_of = gguf.GGMLQuantizationType[kind]
            blocks = gguf.quants.quantize(w, blocks_of)
            writer.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=blocks_of)
        else:
            writer.add_tensor(name, w.astype(np.float16) if (kind == "F16" and w.ndim == 2) else w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
