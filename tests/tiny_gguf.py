"""A tiny Llama GGUF written with the `gguf` package, for the tests that read a file's
blocks as stored: each layer's matrices in chosen quantized types (Q/K rows permuted as
llama.cpp's converter stores them), a Q8_0 token embedding tied to the output layer, F32
norms. The shapes are fixed (HIDDEN, INTER, HEADS, KV_HEADS, LAYERS, VOCAB)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import gguf
import numpy as np

from gguf_convert import llama_cpp_permute

HIDDEN, INTER, HEADS, KV_HEADS, LAYERS, VOCAB = 64, 128, 4, 2, 2, 96
HEAD_DIM = HIDDEN // HEADS
SHAPES = {
    "attn_q": (HIDDEN, HIDDEN),
    "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
    "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN),
    "attn_output": (HIDDEN, HIDDEN),
    "ffn_gate": (INTER, HIDDEN),
    "ffn_up": (INTER, HIDDEN),
    "ffn_down": (HIDDEN, INTER),
}
# Q8_0 and Q4_0 matrices, the two types mixed in q/k/v and in gate/up/down.
Q8_0_Q4_0 = {
    "attn_q": "Q8_0",
    "attn_k": "Q4_0",
    "attn_v": "Q8_0",
    "attn_output": "Q4_0",
    "ffn_gate": "Q8_0",
    "ffn_up": "Q8_0",
    "ffn_down": "Q4_0",
}


def write_tiny_llama_gguf(path: Path, kinds: Mapping[str, str], context_length: int) -> None:
    """The model at `path`, each matrix of SHAPES in the GGML type `kinds` names."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(context_length)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTER)
    writer.add_block_count(LAYERS)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(HEAD_DIM)

    def matrix(name: str, shape: tuple[int, int], kind: str) -> None:
        w = (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32)
        if name.endswith(("attn_q.weight", "attn_k.weight")):
            w = llama_cpp_permute(w, HEADS if "attn_q" in name else KV_HEADS)
        qtype = gguf.GGMLQuantizationType[kind]
        writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)

    matrix("token_embd.weight", (VOCAB, HIDDEN), "Q8_0")  # tied: also the output layer
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    for i in range(LAYERS):
        for norm in ("attn_norm", "ffn_norm"):
            values = rng.uniform(0.8, 1.2, HIDDEN).astype(np.float32)
            writer.add_tensor(f"blk.{i}.{norm}.weight", values)
        for part, shape in SHAPES.items():
            matrix(f"blk.{i}.{part}.weight", shape, kinds[part])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
