"""BlockAllocator: the pool of physical KV blocks, their reference counts, the prefix cache.

Free blocks wait in one queue in the order they will be handed out. A freed block that
holds a full, hashed block of tokens keeps its hash while it waits: a request with the
same prefix takes it back out in O(1) (a cache hit) until the pool hands it to someone
else (an eviction). Uncached free blocks go to the front of the queue and cached ones to
the back, so the least recently used cached block is evicted first and only once no
worthless block is left. With several layer groups (kv/groups.py) each group caches its
own blocks: the cache is keyed by (group, chained hash), the hash itself the same for
every group (kv/block_hash.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from pagedllm.errors import NoFreeBlocksError
from pagedllm.kv.block_hash import hash_block
from pagedllm.kv.events import PoolListener


@dataclass(frozen=True)
class CachedBlock:
    """What a cached block holds, kept to confirm a hash match exactly."""

    block_hash: bytes
    parent_hash: bytes
    token_ids: tuple[int, ...]
    group: int = 0  # the layer group whose K/V the block holds
    lora_id: int = 0  # the adapter it was computed under (0: the base model)


class BlockAllocator:
    """Hands out physical block ids 0..num_blocks-1, reference counted."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        # An OrderedDict is a doubly linked list with a hash index: O(1) pop from the front,
        # append at either end, and removal from the middle on a cache hit.
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._cached_by_hash: dict[tuple[int, bytes], int] = {}
        self._cached_info: dict[int, CachedBlock] = {}
        self.num_evictions = 0
        self.listener: PoolListener | None = None  # the KV view, when one watches
        # Figures of the blocks in use, kept as they change so that reading them each step
        # costs nothing: tokens each block holds, their sum, shared blocks, references.
        self._fill = [0] * num_blocks
        self.tokens_stored = 0
        self.num_shared_blocks = 0
        self.num_references = 0

    # ----------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now, cached-but-unreferenced ones included."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks that carry a prefix-cache hash, referenced or not."""
        return len(self._cached_info)

    def ref_count(self, block: int) -> int:
        self._check(block)
        return self._ref_counts[block]

    def cached_info(self, block: int) -> CachedBlock | None:
        return self._cached_info.get(block)

    # -------------------------------------------------------------- allocation
    def allocate(self) -> int:
        if not self._free:
            raise NoFreeBlocksError("no free KV blocks")
        block, _ = self._free.popitem(last=False)
        info = self._cached_info.pop(block, None)
        if info is not None:
            del self._cached_by_hash[info.group, info.block_hash]
            self.num_evictions += 1
            if self.listener is not None:
                self.listener.on_evicted(block)
        self._ref_counts[block] = 1
        self._fill[block] = 0
        self.num_references += 1
        return block

    def allocate_many(self, n: int) -> list[int]:
        """All or nothing: n blocks, or NoFreeBlocksError and no change."""
        if n > len(self._free):
            raise NoFreeBlocksError(f"asked for {n} KV blocks, {len(self._free)} free")
        return [self.allocate() for _ in range(n)]

    def incref(self, block: int) -> None:
        """One more block-table entry points at `block` (a fork or a cache hit)."""
        self._check(block)
        if self._ref_counts[block] == 0:
            if block not in self._cached_info:
                raise ValueError(f"block {block} is free and not cached; allocate it instead")
            del self._free[block]
            self.tokens_stored += self._fill[block]  # a cached block comes back in use
        self._ref_counts[block] += 1
        self.num_references += 1
        if self._ref_counts[block] == 2:
            self.num_shared_blocks += 1

    def free(self, block: int) -> None:
        """Drop one reference; at zero the block returns to the free queue."""
        self._check(block)
        if self._ref_counts[block] == 0:
            raise ValueError(f"double free of KV block {block}")
        self._ref_counts[block] -= 1
        self.num_references -= 1
        if self._ref_counts[block] == 1:
            self.num_shared_blocks -= 1
        if self._ref_counts[block] == 0:
            self.tokens_stored -= self._fill[block]
            self._free[block] = None
            if block not in self._cached_info:
                self._free.move_to_end(block, last=False)

    def note_filled(self, block: int, num_tokens: int) -> None:
        """`block` (in use) now holds at least `num_tokens` tokens."""
        if num_tokens > self._fill[block]:
            self.tokens_stored += num_tokens - self._fill[block]
            self._fill[block] = num_tokens

    def note_emptied(self, block: int, num_tokens: int) -> None:
        """`block` (in use) now holds only `num_tokens` tokens: slots claimed for proposed
        tokens that were rejected are given back."""
        if num_tokens < self._fill[block]:
            self.tokens_stored -= self._fill[block] - num_tokens
            self._fill[block] = num_tokens

    # ------------------------------------------------------------ prefix cache
    def cached_block(
        self, group: int, block_hash: bytes, parent_hash: bytes, token_ids: Sequence[int]
    ) -> int | None:
        """The cached block of `group` whose hash is `block_hash`, if it holds exactly
        these tokens after this parent."""
        block = self._cached_by_hash.get((group, block_hash))
        if block is None:
            return None
        info = self._cached_info[block]
        # Confirm: a hash collision must never hand out another prefix's K/V.
        if info.parent_hash != parent_hash or info.token_ids != tuple(token_ids):
            return None
        return block

    def register(
        self,
        block: int,
        parent_hash: bytes,
        token_ids: Sequence[int],
        group: int = 0,
        block_hash: bytes | None = None,
        lora_id: int = 0,
    ) -> bytes:
        """Record that `block` holds these (computed) tokens of `group`, computed under
        adapter `lora_id`; returns the block's hash (`block_hash`: that hash, already
        computed). If another block already holds the same content, that one stays the
        cached copy.
        """
        self._check(block)
        if block_hash is None:
            block_hash = hash_block(parent_hash, token_ids)
        key = (group, block_hash)
        if key not in self._cached_by_hash and block not in self._cached_info:
            self._cached_by_hash[key] = block
            self._cached_info[block] = CachedBlock(
                block_hash, parent_hash, tuple(token_ids), group, lora_id
            )
            if self.listener is not None:
                self.listener.on_cached(block)
        return block_hash

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (blocks in use stay in use)."""
        self._cached_by_hash.clear()
        self._cached_info.clear()
        if self.listener is not None:
            self.listener.on_cache_reset()

    def _check(self, block: int) -> None:
        if not 0 <= block < self.num_blocks:
            raise ValueError(
                f"unknown KV block {block}; the pool has blocks 0..{self.num_blocks - 1}"
            )
