"""The memory floor under a decode step: how many bytes of weights a step reads, and how
fast this machine reads memory. At a small batch a step streams every weight once from
memory and computes little, so bytes / bandwidth is the least time it can take.
"""

from __future__ import annotations

import time

import torch

from pagedllm.loader.loaded import LoadedModel, expected_shapes
from pagedllm.model.config import ModelConfig
from pagedllm.model.gguf_linear import GGUFWeight

BUFFER_BYTES = 512 << 20  # far beyond any cache


def weight_bytes_per_step(config: ModelConfig, quantization: str, dtype: str) -> int:
    """Bytes of weights one decode step reads: every linear layer's matrix (the output
    layer's is the embedding when they are tied; the embedding lookup itself reads a row
    per token, nothing here), at one byte each in int8 (plus its fp32 scales of the output
    and the smoothing of the input), else in `dtype`; the norms' vectors in fp32."""
    width = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    shapes = expected_shapes(config)
    if config.tie_word_embeddings:
        shapes["lm_head.weight"] = shapes["model.embed_tokens.weight"]
    total = 0
    for name, shape in shapes.items():
        if name == "model.embed_tokens.weight":
            continue
        if len(shape) == 2:
            out, inp = shape
            total += out * inp + 4 * (out + inp) if quantization == "int8" else out * inp * width
        else:
            total += 4 * shape[0]
    return total


def stored_weight_bytes_per_step(loaded: LoadedModel) -> int:
    """`weight_bytes_per_step` for a GGUF loaded with its blocks kept (quantization="gguf"):
    each linear layer's blocks as the file stores them, the norms' vectors in fp32."""
    weights = dict(loaded.weights)
    if loaded.config.tie_word_embeddings:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    total = 0
    for name, weight in weights.items():
        if name == "model.embed_tokens.weight":
            continue
        total += weight.blocks.numel() if isinstance(weight, GGUFWeight) else 4 * weight.numel()
    return total


def read_bytes_per_second(repeats: int = 5) -> float:
    """The fastest of `repeats` reads of a buffer larger than the caches, on torch's
    threads: what a step that only streamed its weights could reach."""
    buffer = torch.ones(BUFFER_BYTES // 8, dtype=torch.int64)  # written: its pages exist
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return BUFFER_BYTES / best
