"""KVCacheManager: the block tables of all live sequences over one shared pool.

It answers the scheduler's questions in block terms (can this sequence grow by n
tokens? which cached prefix can a new request reuse?) and reports the pool's usage:
the figures the engine exposes at every step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagedllm.kv.allocator import BlockAllocator
from pagedllm.kv.block_table import BlockTable, check_block_size
from pagedllm.kv.events import KVListener


@dataclass(frozen=True)
class KVUsage:
    """A snapshot of the pool."""

    block_size: int
    num_blocks: int
    used_blocks: int
    free_blocks: int
    cached_blocks: int
    tokens_stored: int
    shared_blocks: int
    block_references: int  # block-table entries: the blocks in use were nothing shared

    @property
    def reserved_slots(self) -> int:
        return self.used_blocks * self.block_size

    @property
    def empty_slots(self) -> int:
        """Slots reserved but holding no token: internal fragmentation."""
        return self.reserved_slots - self.tokens_stored

    @property
    def utilization(self) -> float:
        """Tokens stored / slots reserved (1.0 for an empty pool)."""
        return self.tokens_stored / self.reserved_slots if self.reserved_slots else 1.0

    @property
    def blocks_saved_by_sharing(self) -> int:
        return self.block_references - self.used_blocks


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        watermark_blocks: int = 0,
    ) -> None:
        check_block_size(block_size)
        if not 0 <= watermark_blocks < num_blocks:
            raise ValueError(
                f"watermark_blocks must be in [0, {num_blocks - 1}], got {watermark_blocks}"
            )
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark_blocks = watermark_blocks
        self.tables: dict[int, BlockTable] = {}
        self._pending_copies: list[tuple[int, int]] = []
        # Whoever watches the pool (the engine's KV recorders), else None: see set_listener.
        self.listener: KVListener | None = None

    def set_listener(self, listener: KVListener | None) -> None:
        """Send this manager's and its allocator's hooks to `listener` (None: nobody)."""
        self.listener = listener
        self.allocator.listener = listener

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free_blocks

    def table(self, seq_id: int) -> BlockTable:
        return self.tables[seq_id]

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --------------------------------------------------------------- prefix cache
    def find_cached_prefix(self, token_ids: Sequence[int]) -> tuple[list[int], list[bytes]]:
        """Blocks of the longest cached prefix of full blocks, and their hashes.

        The last token is never covered, so the step that admits the sequence still
        computes at least one token and produces logits.
        """
        if not self.enable_prefix_caching:
            return [], []
        blocks: list[int] = []
        hashes: list[bytes] = []
        parent = b""
        bs = self.block_size
        for i in range((len(token_ids) - 1) // bs):
            hit = self.allocator.lookup(parent, token_ids[i * bs : (i + 1) * bs])
            if hit is None:
                break
            blocks.append(hit[0])
            hashes.append(hit[1])
            parent = hit[1]
        return blocks, hashes

    def cache_computed_blocks(
        self, seq_id: int, token_ids: Sequence[int], num_computed_tokens: int
    ) -> None:
        """Offer the sequence's newly computed full blocks to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        table = self.tables[seq_id]
        bs = self.block_size
        for i in range(len(table.block_hashes), num_computed_tokens // bs):
            parent = table.block_hashes[-1] if table.block_hashes else b""
            tokens = token_ids[i * bs : (i + 1) * bs]
            table.block_hashes.append(self.allocator.register(table.blocks[i], parent, tokens))

    # ------------------------------------------------------------------- growth
    def allocate_slots(self, seq_id: int, num_tokens: int) -> bool:
        """Make the sequence's table hold `num_tokens` tokens in all (a new sequence starts
        an empty table). All or nothing: False and no change when the pool cannot serve it.
        """
        table = self.tables.get(seq_id)
        if table is None:
            return self.admit([seq_id], [([], [])], num_tokens)
        copies = table.append_slots(num_tokens)
        if copies is None:
            return False
        self._pending_copies.extend(copies)
        if self.listener is not None:
            self.listener.on_grown(seq_id, table, copies)
        return True

    def admit(
        self,
        seq_ids: Sequence[int],
        cached: Sequence[tuple[list[int], list[bytes]]],
        num_tokens: int,
        reserve_tokens: int = 0,
        keep_watermark: bool = False,
    ) -> bool:
        """Start the tables of a group of new sequences (one request's samples or beams,
        readmitted after preemption) holding `num_tokens` tokens each; all or nothing.

        Each may start from its prefix-cache hits (`cached`: blocks and their hashes) and
        reserve blocks for `reserve_tokens` up front. Admissions keep the watermark free.
        """
        taken = [seq_id for seq_id in seq_ids if seq_id in self.tables]
        if taken:
            raise ValueError(f"sequences {taken} already have block tables")
        target = max(num_tokens, reserve_tokens)
        # Cache hits that sit in the free queue stop being free when taken.
        from_free = {b for hits, _ in cached for b in hits if self.allocator.ref_count(b) == 0}
        new_blocks = sum(max(0, self.blocks_for_tokens(target) - len(hits)) for hits, _ in cached)
        margin = self.watermark_blocks if keep_watermark else 0
        if new_blocks + len(from_free) + margin > self.num_free_blocks:
            return False
        # Take every hit before allocating any new block: an allocation must not evict a
        # block another sequence of the group is about to reuse.
        for seq_id, (hits, hashes) in zip(seq_ids, cached, strict=True):
            table = BlockTable(self.block_size, self.allocator)
            for block, block_hash in zip(hits, hashes, strict=True):
                info = self.allocator.cached_info(block)
                if info is None or info.block_hash != block_hash:
                    raise RuntimeError(f"block {block} is no longer the cached block asked for")
                self.allocator.incref(block)
            if hits:
                table.add_cached_blocks(hits, hashes)
            self.tables[seq_id] = table
        for seq_id in seq_ids:
            table = self.tables[seq_id]
            if reserve_tokens:
                table.reserve(reserve_tokens)
            if table.append_slots(num_tokens):
                raise RuntimeError("a new block table copied a block: it shares none to copy")
        if self.listener is not None:
            for seq_id, (hits, _) in zip(seq_ids, cached, strict=True):
                self.listener.on_admitted(seq_id, self.tables[seq_id], len(hits))
        return True

    def fork(self, parent_id: int, child_id: int) -> None:
        if child_id in self.tables:
            raise ValueError(f"sequence {child_id} already has a block table")
        self.tables[child_id] = self.tables[parent_id].fork()
        if self.listener is not None:
            self.listener.on_forked(parent_id, child_id, self.tables[child_id])

    def free(self, seq_id: int) -> None:
        table = self.tables.pop(seq_id, None)
        if table is None:
            return
        if self._pending_copies:
            # A copy into a block this sequence held would only write into a freed block.
            gone = set(table.blocks)
            self._pending_copies = [c for c in self._pending_copies if c[1] not in gone]
        if self.listener is not None:
            self.listener.on_freed(seq_id, table)
        table.free()

    def take_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write block copies the worker must do before the next forward."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    # ------------------------------------------------------------------ figures
    def usage(self) -> KVUsage:
        """The pool's figures, from counters kept as blocks change (O(1))."""
        alloc = self.allocator
        return KVUsage(
            block_size=self.block_size,
            num_blocks=alloc.num_blocks,
            used_blocks=alloc.num_used_blocks,
            free_blocks=alloc.num_free_blocks,
            cached_blocks=alloc.num_cached_blocks,
            tokens_stored=alloc.tokens_stored,
            shared_blocks=alloc.num_shared_blocks,
            block_references=alloc.num_references,
        )
