"""KV-cache bookkeeping: the block pool, per-sequence block tables (one per layer group)
and their manager.

Plain Python, no torch: these decide which physical block holds which token; the
worker owns the tensors and only ever sees block ids.
"""

from pagedllm.errors import NoFreeBlocksError
from pagedllm.kv.adapter_pages import AdapterPages, AdapterPoolConfig, ResidentAdapter
from pagedllm.kv.allocator import BlockAllocator
from pagedllm.kv.block_table import BlockTable
from pagedllm.kv.groups import KVGroupSpec, group_layers
from pagedllm.kv.manager import KVCacheManager, KVUsage
from pagedllm.kv.sequence_blocks import CachedPrefix, SequenceBlocks

__all__ = [
    "AdapterPages",
    "AdapterPoolConfig",
    "BlockAllocator",
    "BlockTable",
    "CachedPrefix",
    "KVCacheManager",
    "KVGroupSpec",
    "KVUsage",
    "NoFreeBlocksError",
    "ResidentAdapter",
    "SequenceBlocks",
    "group_layers",
]
