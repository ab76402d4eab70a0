"""Before a model loads: will it fit in the memory this machine has?

`check_memory(config)` reads the model's header (loader/memory_estimate.py) and adds what
this engine's options ask for: the weights on the path `quantization` takes, the KV pool
(its blocks at the bytes each takes, sized as the engine will size it) and the working
buffers (the logits of the most rows a step samples). It logs the estimate in one line and
refuses, with InsufficientMemoryError, a model whose peak exceeds the available memory,
saying what would fit instead. Models on another device than the CPU are not checked here
(their weights and pool live in the device's memory).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from pagedllm.engine.config import EngineConfig
from pagedllm.errors import ModelLoadError
from pagedllm.kv.groups import group_layers, group_size, needs_null_block

if TYPE_CHECKING:
    from pagedllm.loader.memory_estimate import MemoryEstimate, ModelHeader

logger = logging.getLogger("pagedllm")
DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_pool_bytes(config: EngineConfig, header: ModelHeader) -> int:
    """The KV pool's bytes, as LLMEngine sizes it for this model (its layer groups, the
    null block of a sliding-window model)."""
    model = header.config
    kv_dtype = config.dtype if config.kv_cache_dtype == "auto" else config.kv_cache_dtype
    per_block = config.block_size * model.kv_bytes_per_token(DTYPE_SIZES[kv_dtype])
    groups = group_layers(
        model.layer_windows, model.num_hidden_layers, not config.disable_hybrid_kv_cache_manager
    )
    block_bytes = -(-per_block * group_size(groups) // model.num_hidden_layers)
    return (config.kv_blocks(block_bytes) + needs_null_block(groups)) * block_bytes


def estimate(config: EngineConfig, header: ModelHeader, quantization: str) -> MemoryEstimate:
    """The memory estimate of `header`'s model under `config`, on the path `quantization`."""
    from pagedllm.loader.memory_estimate import MemoryEstimate, buffer_bytes, weight_memory

    rows_per_seq = 1 + (config.num_speculative_tokens or 0)
    logits_rows = min(config.max_num_seqs * rows_per_seq, config.max_num_batched_tokens)
    return MemoryEstimate(
        weight_memory(header, quantization, DTYPE_SIZES[config.dtype]),
        kv_pool_bytes(config, header),
        buffer_bytes(header.config, config.max_num_batched_tokens, logits_rows),
    )


def _advice(config: EngineConfig, header: ModelHeader, available: int) -> str:
    """What would fit in `available` bytes: the KV pool that leaves room for the weights and
    buffers, on this path or another quantization's."""
    from pagedllm.loader.memory_estimate import format_bytes

    ways = []
    others = [q for q in ("none", "gguf", "int8") if q != config.quantization]
    for quantization in [config.quantization, *(others if config.dtype == "float32" else [])]:
        if quantization == "gguf" and not header.keeps_blocks:
            continue
        path = estimate(config, header, quantization)
        room = available - path.weights.held - path.buffers
        if path.weights.loading > available or room <= 0:
            continue
        pool = f"a KV pool of at most {format_bytes(room)} (--kv-cache-memory)"
        if quantization == config.quantization:
            ways.append(pool)
        else:
            ways.append(f"--quantization {quantization} with {pool}")
    if not ways:
        ways.append(
            "a smaller model, or this model as a GGUF of a smaller quantization (Q4_K_M: "
            "about 4.8 bits a weight), whose blocks --quantization auto keeps as stored"
        )
    return "To fit: " + "; or ".join(ways) + "."


def check_memory(config: EngineConfig) -> None:
    """Log the memory `config.model` will need on the path `config.quantization` names
    (decided: not "auto"); InsufficientMemoryError if it exceeds what the machine has
    available. A model that cannot be read is left to the loader to report."""
    if not config.device.startswith("cpu"):
        return
    from pagedllm.loader import memory_estimate as memory
    from pagedllm.loader import resolve_model_path

    try:
        path = resolve_model_path(config.model)
        if not os.path.exists(path):
            return
        header = memory.read_model_header(path)
    except (ModelLoadError, ValueError, KeyError, TypeError):
        return  # the loader says what is wrong with the model, in its own words
    if config.quantization == "gguf" and not header.is_gguf:
        return  # refused by the loader
    chosen = estimate(config, header, config.quantization)
    available = memory.available_memory()
    free = "unknown" if available is None else memory.format_bytes(available)
    logger.info("memory: %s needs %s; %s available", path, chosen.describe(), free)
    memory.check_fits(chosen, available, path, lambda: _advice(config, header, available or 0))
