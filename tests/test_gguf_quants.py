"""GGUF tensor types: a tiny Qwen2 GGUF whose matrices are stored as Q4_K, Q5_K, Q6_K,
Q8_0, Q4_0, Q5_0, F16 or BF16 loads with every weight equal to an independent decoding
of the stored bytes (ggml_blocks: the formats' C loops, written out; F16/BF16 by bit
arithmetic). The quantized blocks are random bytes, so every bit pattern is exercised."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from ggml_blocks import BLOCKS, decode, random_blocks
from pagedllm.loader import load_model
from pagedllm.loader.gguf_tensors import hf_name

HIDDEN, HEADS, KV_HEADS, VOCAB = 256, 4, 2, 32  # rows of 256: whole K-quant blocks
KV_DIM = KV_HEADS * HIDDEN // HEADS
MATRICES = {
    "token_embd.weight": (VOCAB, HIDDEN),
    "blk.0.attn_q.weight": (HIDDEN, HIDDEN),
    "blk.0.attn_k.weight": (KV_DIM, HIDDEN),
    "blk.0.attn_v.weight": (KV_DIM, HIDDEN),
    "blk.0.attn_output.weight": (HIDDEN, HIDDEN),
    "blk.0.ffn_gate.weight": (HIDDEN, HIDDEN),
    "blk.0.ffn_up.weight": (HIDDEN, HIDDEN),
    "blk.0.ffn_down.weight": (HIDDEN, HIDDEN),
}
NORMS = ("output_norm.weight", "blk.0.attn_norm.weight", "blk.0.ffn_norm.weight")


def _stored(kind: str, shape: tuple[int, int], seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(bytes or values to write, the float32 weight they mean)."""
    rng = np.random.default_rng(seed)
    if kind in BLOCKS:
        raw = random_blocks(kind, *shape, seed=seed)
        return raw, decode(kind, raw).astype(np.float32)
    values = rng.standard_normal(shape).astype(np.float32)
    if kind == "F16":
        half = values.astype(np.float16)
        return half, half.astype(np.float32)
    # BF16: the top 16 bits of a float32; their meaning is those bits shifted back up.
    bits = (values.view(np.uint32) >> 16).astype(np.uint16)
    return bits.view(np.uint8).reshape(shape[0], -1), (bits.astype(np.uint32) << 16).view(
        np.float32
    )


def write_quantized(path: Path, kind: str) -> dict[str, np.ndarray]:
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_context_length(64)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(HIDDEN)
    writer.add_block_count(1)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-6)
    expected: dict[str, np.ndarray] = {}
    for seed, (name, shape) in enumerate(MATRICES.items()):
        data, weight = _stored(kind, shape, seed)
        qtype = gguf.GGMLQuantizationType[kind]
        if data.dtype == np.uint8:
            writer.add_tensor(name, data, raw_dtype=qtype)
        else:
            writer.add_tensor(name, data)
        expected[name] = weight
    for name in NORMS:
        expected[name] = np.linspace(0.5, 1.5, HIDDEN, dtype=np.float32)
        writer.add_tensor(name, expected[name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0", "Q5_0", "F16", "BF16"])
def test_each_tensor_type_loads_as_its_independent_decoding(tmp_path: Path, kind: str) -> None:
    path = tmp_path / f"{kind}.gguf"
    expected = write_quantized(path, kind)
    loaded = load_model(str(path))
    assert loaded.config.tie_word_embeddings and loaded.config.architecture == "qwen2"
    assert len(loaded.weights) == len(expected)
    for name, weight in expected.items():
        got = loaded.weights[str(hf_name(name))].numpy()
        assert got.shape == weight.shape, name
        np.testing.assert_allclose(got, weight, rtol=1e-6, atol=1e-7, err_msg=name)
    # Not all zeros or all one value: the blocks mean something.
    assert np.std(loaded.weights["model.layers.0.mlp.down_proj.weight"].numpy()) > 0
