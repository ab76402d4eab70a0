"""Real-shaped GGUF files of random weights, written tensor by tensor, for the benches.

A `ModelShape` is a decoder's dimensions (SmolLM2-1.7B's and Qwen2.5-7B's are in SHAPES).
`write_random_gguf` writes one as F16 with the `gguf` package: matrices N(0, 0.02), norms
1, biases N(0, 0.02), and a tokenizer copied from another GGUF (padded with unused tokens
to the shape's vocabulary). Each matrix is drawn and written in chunks of rows while the
file is written, so a 15 GB model never sits in memory. llama.cpp's `llama-quantize` then
turns the F16 file into the quantized mixes people run (bench/llamacpp.py).
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Iterator
from dataclasses import astuple, dataclass
from typing import IO, Any

import gguf
import numpy as np

ARCHITECTURES = ("llama", "qwen2")
WEIGHT_STD = 0.02
CHUNK_VALUES = 1 << 20  # values drawn at a time: 4 MiB of float32
UNUSED_TOKEN = gguf.TokenType.UNUSED


@dataclass(frozen=True)
class ModelShape:
    """A decoder's dimensions, and the llama.cpp architecture its file names."""

    name: str
    arch: str  # "llama" or "qwen2"
    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    rope_base: float
    rms_eps: float = 1e-5
    context: int = 8192
    qkv_bias: bool = False  # Qwen2's q/k/v projections carry biases
    tied_embeddings: bool = True  # no output.weight: the embedding is the output layer

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"arch must be one of {', '.join(ARCHITECTURES)}, got {self.arch!r}")
        sizes = (self.hidden, self.ffn, self.layers, self.heads, self.kv_heads, self.vocab)
        if min(sizes) < 1:
            raise ValueError(f"{self.name}: every dimension must be positive, got {sizes}")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(
                f"{self.name}: hidden ({self.hidden}) must divide into heads ({self.heads}), "
                f"and heads into KV heads ({self.kv_heads})"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def file_stem(self, seed: int) -> str:
        """A name that changes with any dimension or the seed: a cached file is reused
        only for the same shape and weights."""
        digest = hashlib.sha256(repr((astuple(self), seed)).encode()).hexdigest()[:12]
        return f"{self.name}-random-s{seed}-{digest}"

    def tensors(self) -> Iterator[tuple[str, tuple[int, ...], str]]:
        """(GGUF name, shape in numpy order, "matrix" | "norm" | "bias") of every tensor."""
        kv = self.kv_heads * self.head_dim
        yield "token_embd.weight", (self.vocab, self.hidden), "matrix"
        yield "output_norm.weight", (self.hidden,), "norm"
        if not self.tied_embeddings:
            yield "output.weight", (self.vocab, self.hidden), "matrix"
        for i in range(self.layers):
            yield f"blk.{i}.attn_norm.weight", (self.hidden,), "norm"
            for part, rows in (("attn_q", self.hidden), ("attn_k", kv), ("attn_v", kv)):
                yield f"blk.{i}.{part}.weight", (rows, self.hidden), "matrix"
                if self.qkv_bias:
                    yield f"blk.{i}.{part}.bias", (rows,), "bias"
            yield f"blk.{i}.attn_output.weight", (self.hidden, self.hidden), "matrix"
            yield f"blk.{i}.ffn_norm.weight", (self.hidden,), "norm"
            yield f"blk.{i}.ffn_gate.weight", (self.ffn, self.hidden), "matrix"
            yield f"blk.{i}.ffn_up.weight", (self.ffn, self.hidden), "matrix"
            yield f"blk.{i}.ffn_down.weight", (self.hidden, self.ffn), "matrix"

    def f16_bytes(self) -> int:
        """The tensors' bytes in the F16 file (matrices F16, vectors F32)."""
        return sum(
            int(np.prod(shape)) * (2 if kind == "matrix" else 4)
            for _, shape, kind in self.tensors()
        )


SHAPES = {
    shape.name: shape
    for shape in (
        ModelShape(
            "smollm2-1.7b", "llama", hidden=2048, ffn=8192, layers=24, heads=32, kv_heads=32,
            vocab=49152, rope_base=130000.0, rms_eps=1e-5, context=8192,
        ),
        ModelShape(
            "qwen2.5-7b", "qwen2", hidden=3584, ffn=18944, layers=28, heads=28, kv_heads=4,
            vocab=152064, rope_base=1000000.0, rms_eps=1e-6, context=32768, qkv_bias=True,
            tied_embeddings=False,
        ),
    )
}  # fmt: skip


class RandomTensor:
    """Random values of `shape` as `dtype`, drawn in chunks of rows as they are written:
    what GGUFWriter.write_tensor_data needs of an array (`nbytes`, `tofile`), without the
    array."""

    def __init__(
        self, shape: tuple[int, ...], dtype: type[np.generic], rng: np.random.Generator
    ) -> None:
        self.shape, self.dtype, self.rng = shape, np.dtype(dtype), rng
        self.nbytes = int(np.prod(shape)) * self.dtype.itemsize

    def tofile(self, f: IO[bytes]) -> None:
        rows, cols = (1, self.shape[0]) if len(self.shape) == 1 else self.shape
        step = max(1, CHUNK_VALUES // cols)
        for start in range(0, rows, step):
            n = min(step, rows - start)
            values = self.rng.standard_normal((n, cols), dtype=np.float32)
            values *= WEIGHT_STD
            values.astype(self.dtype).tofile(f)


@functools.cache  # reading 100,000 strings takes seconds; several models copy one source
def tokenizer_fields(source: str) -> list[tuple[str, Any, gguf.GGUFValueType, Any]]:
    """Every `tokenizer.*` key of the GGUF at `source`: (key, value, type, element type)."""
    reader = gguf.GGUFReader(source)
    fields = []
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            fields.append((key, field.contents(), field.types[0], sub))
    return fields


def padded_vocabulary(
    fields: list[tuple[str, Any, gguf.GGUFValueType, Any]], vocab: int, source: str
) -> list[tuple[str, Any, gguf.GGUFValueType, Any]]:
    """The tokenizer `fields` with unused tokens appended up to `vocab` tokens."""
    out = []
    for key, value, kind, sub in fields:
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
            if len(value) > vocab:
                raise ValueError(
                    f"{source} has {len(value)} tokens, more than the vocabulary of {vocab}"
                )
            pad = vocab - len(value)
            if key == "tokenizer.ggml.tokens":
                value = [*value, *(f"<|unused_{i}|>" for i in range(pad))]
            else:
                value = [*value, *([int(UNUSED_TOKEN)] if "type" in key else [0.0]) * pad]
        out.append((key, value, kind, sub))
    return out


def write_random_gguf(path: str, shape: ModelShape, seed: int, tokenizer_source: str) -> None:
    """Write `shape` as an F16 GGUF of random weights at `path` (see the module docstring),
    through a temporary name: a file at `path` is always complete."""
    partial = f"{path}.partial"
    writer = gguf.GGUFWriter(partial, shape.arch)
    a = shape.arch
    writer.add_name(f"{shape.name} (random weights, seed {seed})")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_block_count(shape.layers)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_base)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_uint32(f"{a}.vocab_size", shape.vocab)
    for key, value, kind, sub in padded_vocabulary(
        tokenizer_fields(tokenizer_source), shape.vocab, tokenizer_source
    ):
        writer.add_key_value(key, value, kind, sub)
    tensors = list(shape.tensors())
    for name, dims, kind in tensors:
        dtype = np.float16 if kind == "matrix" else np.float32
        writer.add_tensor_info(
            name, dims, np.dtype(dtype), int(np.prod(dims)) * np.dtype(dtype).itemsize
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for _, dims, kind in tensors:
        if kind == "norm":
            writer.write_tensor_data(np.ones(dims, dtype=np.float32))
        else:
            dtype = np.float16 if kind == "matrix" else np.float32
            writer.write_tensor_data(RandomTensor(dims, dtype, rng))  # type: ignore[arg-type]
    writer.close()
    os.replace(partial, path)
