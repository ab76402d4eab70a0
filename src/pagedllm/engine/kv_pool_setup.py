"""The KV pool an engine starts with: its layer groups, block count and max_model_len.

Sized from the engine's configuration (memory or block count, watermark) and the runner's
bytes per block. With sliding-window layer groups a block holds one group's layers, so a
block costs that group's share of a block of every layer, and the longest request that
fits is found against the blocks such a sequence really holds. The runner gets the same
layout for its tensors.

With LoRA enabled the same pool holds the adapters' pages (kv/adapter_pages.py): shared
with KV block by block ("unified", S-LoRA's unified paging), or, with lora_slots "static",
max_loras slots of the largest adapter's size taken out of it at start (vLLM's fixed split).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pagedllm.engine.config import EngineConfig
from pagedllm.errors import InvalidParameterError
from pagedllm.kv.adapter_pages import AdapterPoolConfig
from pagedllm.kv.groups import group_layers, group_size
from pagedllm.kv.manager import KVCacheManager
from pagedllm.worker.runner import ModelRunner

logger = logging.getLogger("pagedllm")


@dataclass(frozen=True)
class KVPool:
    kv: KVCacheManager
    max_model_len: int


def build_kv_pool(config: EngineConfig, runner: ModelRunner) -> KVPool:
    """The block manager over a pool sized for `config`, and the longest request it takes;
    the runner's KV tensors are allocated to match."""
    spec = runner.spec
    groups = group_layers(
        spec.layer_windows, spec.num_layers, not config.disable_hybrid_kv_cache_manager
    )
    adapters = None
    if config.enable_lora:  # one layer group only: the runner refuses more
        max_adapter_pages = runner.max_adapter_pages(config.block_size)
        adapters = (
            AdapterPoolConfig("static", config.max_loras, max_adapter_pages)
            if config.lora_slots == "static"
            else AdapterPoolConfig("unified")
        )
    block_bytes = -(
        -runner.kv_bytes_per_block(config.block_size) * group_size(groups) // spec.num_layers
    )
    sizing = KVCacheManager(1, config.block_size, groups=groups)  # counts blocks only
    # Static slots are out of KV's reach for good: the longest request fits in the rest.
    reserved = adapters.reserved_blocks if adapters is not None else 0
    num_blocks, watermark_blocks, max_len = config.pool_size(
        block_bytes,
        spec.max_position_embeddings,
        lambda n: sizing.blocks_for_tokens(n, min(n, config.max_num_batched_tokens)) + reserved,
    )
    if reserved and reserved + 1 > num_blocks - watermark_blocks:
        raise InvalidParameterError(
            "max_loras",
            f"{config.max_loras} static LoRA slots of {reserved // config.max_loras} pages take "
            f"{reserved} of the pool's {num_blocks} blocks, leaving KV none: lower max_loras or "
            "max_lora_rank, or give the pool more memory",
        )
    kv = KVCacheManager(
        num_blocks,
        config.block_size,
        enable_prefix_caching=config.enable_prefix_caching,
        watermark_blocks=watermark_blocks,
        groups=groups,
        adapters=adapters,
    )
    runner.init_kv_cache(
        num_blocks, config.block_size, tuple(g.layers for g in groups), kv.null_block is not None
    )
    logger.info(
        "KV pool: %d blocks x %d tokens x %d bytes/block = %.1f MiB; max_model_len %d; "
        "%d layer group(s) of %d layers, windows %s",
        num_blocks,
        config.block_size,
        block_bytes,
        num_blocks * block_bytes / 2**20,
        max_len,
        len(groups),
        group_size(groups),
        [g.window for g in groups],
    )
    if adapters is not None:
        logger.info(
            "LoRA: lora_slots %s (%d pages reserved); an adapter of rank %d on every target "
            "takes %d pages",
            adapters.mode,
            reserved,
            config.max_lora_rank,
            max_adapter_pages,
        )
    return KVPool(kv, max_len)
