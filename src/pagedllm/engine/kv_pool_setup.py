"""The KV pool an engine starts with: its layer groups, block count and max_model_len.

Sized from the engine's configuration (memory or block count, watermark) and the runner's
bytes per block. With sliding-window layer groups a block holds one group's layers, so a
block costs that group's share of a block of every layer, and the longest request that
fits is found against the blocks such a sequence really holds. The runner gets the same
layout for its tensors.
"""

from __future__ import annotations

import logging

from pagedllm.engine.config import EngineConfig
from pagedllm.kv.groups import group_layers, group_size
from pagedllm.kv.manager import KVCacheManager
from pagedllm.worker.runner import ModelRunner

logger = logging.getLogger("pagedllm")


def build_kv_pool(config: EngineConfig, runner: ModelRunner) -> tuple[KVCacheManager, int]:
    """(the block manager over a pool sized for `config`, max_model_len); the runner's KV
    tensors are allocated to match."""
    spec = runner.spec
    groups = group_layers(
        spec.layer_windows, spec.num_layers, not config.disable_hybrid_kv_cache_manager
    )
    block_bytes = -(
        -runner.kv_bytes_per_block(config.block_size) * group_size(groups) // spec.num_layers
    )
    sizing = KVCacheManager(1, config.block_size, groups=groups)  # counts blocks only
    num_blocks, watermark_blocks, max_len = config.pool_size(
        block_bytes,
        spec.max_position_embeddings,
        lambda n: sizing.blocks_for_tokens(n, min(n, config.max_num_batched_tokens)),
    )
    kv = KVCacheManager(
        num_blocks,
        config.block_size,
        enable_prefix_caching=config.enable_prefix_caching,
        watermark_blocks=watermark_blocks,
        groups=groups,
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
    return kv, max_len
