"""KVCacheManager: the block tables of all live sequences over one shared pool.

It answers the scheduler's questions in block terms (can this sequence grow by n
tokens? which cached prefix can a new request reuse?) and reports the pool's usage:
the figures the engine exposes at every step. Each sequence has one table per layer
group (kv/groups.py); each group's attention kind (kv/attention_kinds.py) says which
leading blocks it gives back as the sequence grows and which a prefix-cache hit needs.
LoRA adapters (`adapters=`) hold pages of the same pool (kv/adapter_pages.py): an
allocation evicts unpinned ones before it fails, and a sequence's prefix-cache chain
starts from its adapter's root hash, so prefixes are shared within an adapter only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagedllm.kv.adapter_pages import AdapterPages, AdapterPoolConfig
from pagedllm.kv.allocator import BlockAllocator
from pagedllm.kv.attention_kinds import FullAttention
from pagedllm.kv.block_hash import hashed_blocks, reusable_blocks, root_hash
from pagedllm.kv.block_table import BlockTable, check_block_size
from pagedllm.kv.events import KVListener
from pagedllm.kv.groups import KVGroupSpec, needs_null_block
from pagedllm.kv.sequence_blocks import CachedPrefix, SequenceBlocks
from pagedllm.validation import check_int


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
    # Blocks LoRA adapters hold (resident pages, or the static slots' reserve); not in
    # used_blocks, which counts KV blocks only: used + adapter + free = num_blocks.
    adapter_blocks: int = 0

    @property
    def reserved_slots(self) -> int:
        return self.used_blocks * self.block_size

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
        groups: Sequence[KVGroupSpec] | None = None,
        adapters: AdapterPoolConfig | None = None,
    ) -> None:
        """`groups`: the model's layer groups (default: one full-attention group);
        `adapters`: how LoRA adapters share the pool (None: no adapters)."""
        check_block_size(block_size)
        if not 0 <= watermark_blocks < num_blocks:
            raise ValueError(
                f"watermark_blocks must be in [0, {num_blocks - 1}], got {watermark_blocks}"
            )
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark_blocks = watermark_blocks
        self.groups: tuple[KVGroupSpec, ...] = (
            tuple(groups) if groups else (KVGroupSpec(FullAttention(), (0,)),)
        )
        self.kinds = tuple(g.kind for g in self.groups)
        self.windows = tuple(k.window for k in self.kinds)
        # The id past the pool that stands for blocks given back behind a window: never
        # handed out, freed or counted; the worker's cache holds one extra block for it.
        self.null_block: int | None = num_blocks if needs_null_block(self.groups) else None
        self.tables: dict[int, SequenceBlocks] = {}
        self.num_dropped_blocks = 0  # table entries given back behind a window, ever
        self._pending_copies: list[tuple[int, int]] = []
        # Whoever watches the pool (the engine's KV recorders), else None: see set_listener.
        self.listener: KVListener | None = None
        self.adapters: AdapterPages | None = None
        if adapters is not None:
            if adapters.reserved_blocks + watermark_blocks >= num_blocks:
                raise ValueError(
                    f"the static adapter slots ({adapters.reserved_blocks} blocks) and the "
                    f"watermark ({watermark_blocks}) leave no KV block of {num_blocks}"
                )
            self.adapters = AdapterPages(self.allocator, adapters)

    def set_listener(self, listener: KVListener | None) -> None:
        """Send this manager's, its allocator's and its adapters' hooks to `listener`
        (None: nobody)."""
        self.listener = listener
        self.allocator.listener = listener
        if self.adapters is not None:
            self.adapters.listener = listener

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free_blocks

    @property
    def num_available_blocks(self) -> int:
        """Free blocks plus the pages of unpinned adapters an allocation would evict."""
        evictable = self.adapters.evictable_blocks() if self.adapters is not None else 0
        return self.allocator.num_free_blocks + evictable

    @property
    def num_kv_blocks(self) -> int:
        """Blocks KV may ever hold: the pool less the static adapter slots' reserve."""
        adapters = self.adapters
        reserved = adapters.config.reserved_blocks if adapters is not None else 0
        return self.allocator.num_blocks - reserved

    def adapter_pages_to_load(self, lora_id: int, num_pages: int) -> int:
        """Blocks admitting a request under adapter `lora_id` would take for the adapter
        (0: the base model, resident already, or a static slot)."""
        if lora_id == 0 or self.adapters is None:
            return 0
        return self.adapters.pages_to_load(lora_id, num_pages)

    def adapter_pages_to_pin(self, lora_id: int, num_pages: int) -> int:
        """Blocks that pinning adapter `lora_id` takes out of `num_available_blocks`: its
        pages if it must be loaded, or if it is resident unpinned (evictable until then)."""
        adapters = self.adapters
        if lora_id == 0 or adapters is None or adapters.static:
            return 0
        resident = adapters.resident.get(lora_id)
        if resident is None:
            return num_pages
        return len(resident.pages) if resident.pins == 0 else 0

    def _make_room(self, num_blocks: int) -> bool:
        """At least `num_blocks` free blocks, evicting unpinned adapters if needed."""
        if num_blocks <= self.allocator.num_free_blocks:
            return True
        return self.adapters is not None and self.adapters.evict_for(num_blocks)

    def block_tables(self, seq_id: int) -> tuple[tuple[int, ...], ...]:
        """The sequence's block tables, one per group, as plain data for the worker."""
        return tuple(tuple(t.blocks) for t in self.tables[seq_id].groups)

    def blocks_for_tokens(
        self, num_tokens: int, chunk: int | None = None, reserve_tokens: int = 0
    ) -> int:
        """Blocks one sequence of `num_tokens` tokens holds at most over every group,
        computed `chunk` tokens a step (default: all at once), with `reserve_tokens`
        reserved up front in every group (the contiguous-reservation baselines)."""
        chunk = num_tokens if chunk is None else chunk
        held = sum(k.blocks_held(num_tokens, self.block_size, chunk) for k in self.kinds)
        return max(held, self.num_groups * -(-reserve_tokens // self.block_size))

    # --------------------------------------------------------------- prefix cache
    def lookup_prefix(
        self, token_ids: Sequence[Sequence[int]], use_cache: bool = True, lora_id: int = 0
    ) -> list[CachedPrefix]:
        """The longest prefix of full blocks that every one of these sequences (one
        request's, under adapter `lora_id`: 0 for the base model) can take from the prefix
        cache, as each sequence's hit; none when `use_cache` is False (a request that
        must compute its whole prompt). Only blocks computed under the same adapter hit.

        Each group's attention kind says which of the prefix's blocks it needs cached
        (kv/attention_kinds.py); the block holding the last token is never covered
        (kv/block_hash.py `reusable_blocks`).
        """
        empty = CachedPrefix.empty(self.num_groups)
        if not self.enable_prefix_caching or not use_cache or not token_ids:
            return [empty for _ in token_ids]
        found = [self._cached_blocks(ids, root_hash(lora_id)) for ids in token_ids]
        n = min(len(hashes) for _, hashes in found)
        while n > 0 and not all(self._is_hit(blocks, n) for blocks, _ in found):
            n -= 1
        if n == 0:
            return [empty for _ in token_ids]
        return [self._hit(blocks, hashes, n) for blocks, hashes in found]

    def _cached_blocks(
        self, token_ids: Sequence[int], root: bytes
    ) -> tuple[list[list[int | None]], list[bytes]]:
        """Per group, the cached block of each reusable leading block (None: not cached),
        and their hashes: as far as the groups that keep every block all hit."""
        bs = self.block_size
        keep_all = [g for g, kind in enumerate(self.kinds) if not kind.drops_blocks]
        blocks: list[list[int | None]] = [[] for _ in self.groups]
        hashes: list[bytes] = []
        for parent, tokens, block_hash in hashed_blocks(
            token_ids, bs, reusable_blocks(len(token_ids), bs), parent_hash=root
        ):
            row = [
                self.allocator.cached_block(g, block_hash, parent, tokens)
                for g in range(self.num_groups)
            ]
            if any(row[g] is None for g in keep_all):
                break
            for g, block in enumerate(row):
                blocks[g].append(block)
            hashes.append(block_hash)
        return blocks, hashes

    def _is_hit(self, blocks: list[list[int | None]], n: int) -> bool:
        """Whether the first `n` blocks serve as a hit in every group."""
        return all(kind.is_hit(blocks[g], n, self.block_size) for g, kind in enumerate(self.kinds))

    def _hit(self, blocks: list[list[int | None]], hashes: list[bytes], n: int) -> CachedPrefix:
        tables = []
        for g, kind in enumerate(self.kinds):
            first = kind.first_needed_block(n * self.block_size, self.block_size)
            row = [self.null_block] * first + blocks[g][first:n]
            tables.append(tuple(int(b) for b in row if b is not None))
        return CachedPrefix(tuple(tables), tuple(hashes[:n]))

    def cache_computed_blocks(
        self, seq_id: int, token_ids: Sequence[int], num_computed_tokens: int
    ) -> None:
        """Offer the sequence's newly computed full blocks to the prefix cache, each in
        its group (a block already given back behind a window is only hashed)."""
        if not self.enable_prefix_caching:
            return
        seq = self.tables[seq_id]
        tables = seq.groups
        hashed = tables[0].block_hashes
        start = len(hashed)
        new_blocks = hashed_blocks(
            token_ids,
            self.block_size,
            num_computed_tokens // self.block_size,
            start,
            hashed[-1] if hashed else root_hash(seq.lora_id),
        )
        for i, (parent, tokens, block_hash) in enumerate(new_blocks, start):
            for g, table in enumerate(tables):
                if table.blocks[i] != self.null_block:
                    self.allocator.register(
                        table.blocks[i], parent, tokens, g, block_hash, seq.lora_id
                    )
                table.block_hashes.append(block_hash)

    # ------------------------------------------------------------------- growth
    def allocate_slots(self, seq_id: int, num_tokens: int) -> bool:
        """Make the sequence's tables hold `num_tokens` tokens in all (a new sequence
        starts empty tables), after each window group gives back the blocks behind the
        window of the first token this step computes (the first the tables do not hold
        yet). All or nothing: False and no new block when the pool cannot serve it.
        """
        seq = self.tables.get(seq_id)
        if seq is None:
            return self.admit([seq_id], [CachedPrefix.empty(self.num_groups)], num_tokens)
        for g, (table, kind) in enumerate(zip(seq.groups, self.kinds, strict=True)):
            if kind.drops_blocks:
                dropped = table.drop_blocks_before(kind.first_needed_token(table.num_tokens))
                self.num_dropped_blocks += len(dropped)
                if dropped and self.listener is not None:
                    self.listener.on_dropped(seq_id, table, dropped, group=g)
        needed = sum(t.blocks_needed(num_tokens) for t in seq.groups)
        if not self._make_room(needed):
            return False
        for g, table in enumerate(seq.groups):
            copies = table.append_slots(num_tokens)
            if copies is None:
                raise RuntimeError("a table could not grow though the pool had its blocks")
            self._pending_copies.extend(copies)
            if self.listener is not None:
                self.listener.on_grown(seq_id, table, copies, group=g)
        return True

    def trim_slots(self, seq_id: int, num_tokens: int, lookahead: int = 0) -> None:
        """Shrink the sequence's tables to `num_tokens` tokens in every group: the slots
        claimed for proposed tokens that were rejected come back, and a block holding
        only such tokens returns to the pool (speculative decoding). `lookahead`: how
        many of the slots the tables claim now were claimed for proposals (listeners
        hear of every check, one that kept all its proposals too)."""
        for g, table in enumerate(self.tables[seq_id].groups):
            before = table.num_tokens
            given_back = table.truncate(num_tokens)
            if (lookahead or table.num_tokens != before) and self.listener is not None:
                self.listener.on_trimmed(seq_id, table, given_back, lookahead, group=g)

    def admit(
        self,
        seq_ids: Sequence[int],
        cached: Sequence[CachedPrefix],
        num_tokens: int,
        reserve_tokens: int = 0,
        keep_watermark: bool = False,
        lora_id: int = 0,
        lora_pages: int = 0,
        lora_path: str | None = None,
    ) -> bool:
        """Start the tables of a group of new sequences (one request's samples or beams,
        readmitted after preemption) holding `num_tokens` tokens each; all or nothing.

        Each may start from its prefix-cache hit (`cached`) and reserve blocks for
        `reserve_tokens` up front. Admissions keep the watermark free (pages of unpinned
        adapters count as free: an allocation evicts them). With `lora_id` > 0 the group
        runs under that adapter: admission pins it (one pin for the group; release it
        with `unpin_adapter`), loading it into `lora_pages` pages if it is not resident.
        """
        taken = [seq_id for seq_id in seq_ids if seq_id in self.tables]
        if taken:
            raise ValueError(f"sequences {taken} already have block tables")
        adapters = self.adapters
        if lora_id and adapters is None:
            raise ValueError(f"adapter {lora_id} asked of a pool that holds no adapters")
        if lora_id:  # before anything is taken: admission is all or nothing
            check_int(lora_pages, "lora_pages", min=1)
        target = max(num_tokens, reserve_tokens)
        null = self.null_block
        # Cache hits that sit in the free queue stop being free when taken.
        from_free = {
            b
            for hit in cached
            for table in hit.tables
            for b in table
            if b != null and self.allocator.ref_count(b) == 0
        }
        per_group = max(0, -(-target // self.block_size))
        new_blocks = sum(max(0, per_group - hit.num_blocks) * self.num_groups for hit in cached)
        margin = self.watermark_blocks if keep_watermark else 0
        load = self.adapter_pages_to_load(lora_id, lora_pages)
        evictable = adapters.evictable_blocks(keep=lora_id) if adapters is not None else 0
        if new_blocks + len(from_free) + margin + load > self.num_free_blocks + evictable:
            return False
        if (
            lora_id
            and adapters is not None
            and adapters.static
            and not adapters.can_pin(lora_id, lora_pages, 0)
        ):
            return False  # static: no slot free and none to evict
        # Take every hit before allocating any new block: an allocation must not evict a
        # block another sequence of the group is about to reuse.
        for seq_id, hit in zip(seq_ids, cached, strict=True):
            tables = []
            for g, entries in enumerate(hit.tables):
                table = BlockTable(self.block_size, self.allocator, null)
                for block, block_hash in zip(entries, hit.hashes, strict=True):
                    if block == null:
                        continue
                    info = self.allocator.cached_info(block)
                    if info is None or info.block_hash != block_hash or info.group != g:
                        raise RuntimeError(f"block {block} is no longer the cached block asked for")
                    self.allocator.incref(block)
                if entries:
                    table.add_cached_blocks(list(entries), list(hit.hashes))
                tables.append(table)
            self.tables[seq_id] = SequenceBlocks(tables, lora_id)
        # The adapter's pages, then the new blocks: after the hits, so neither evicts one.
        if lora_id and adapters is not None and not adapters.pin(lora_id, lora_pages, lora_path):
            raise RuntimeError(f"adapter {lora_id} could not be pinned though it was counted")
        if not self._make_room(new_blocks):
            raise RuntimeError("unpinned adapters could not give back the blocks counted")
        for seq_id in seq_ids:
            for table in self.tables[seq_id].groups:
                if reserve_tokens:
                    table.reserve(reserve_tokens)
                if table.append_slots(num_tokens):
                    raise RuntimeError("a new block table copied a block: it shares none to copy")
        if self.listener is not None:
            for seq_id, hit in zip(seq_ids, cached, strict=True):
                for g, table in enumerate(self.tables[seq_id].groups):
                    self.listener.on_admitted(seq_id, table, hit.num_blocks, group=g)
        return True

    def fork(self, parent_id: int, child_id: int) -> None:
        if child_id in self.tables:
            raise ValueError(f"sequence {child_id} already has a block table")
        parent = self.tables[parent_id]
        self.tables[child_id] = child = SequenceBlocks(
            [t.fork() for t in parent.groups], parent.lora_id
        )
        if self.listener is not None:
            for g, table in enumerate(child.groups):
                self.listener.on_forked(parent_id, child_id, table, group=g)

    def free(self, seq_id: int) -> None:
        seq = self.tables.pop(seq_id, None)
        if seq is None:
            return
        if self._pending_copies:
            # A copy into a block this sequence held would only write into a freed block.
            gone = set(seq.blocks)
            self._pending_copies = [c for c in self._pending_copies if c[1] not in gone]
        for g, table in enumerate(seq.groups):
            if self.listener is not None:
                self.listener.on_freed(seq_id, table, group=g)
            table.free()

    def unpin_adapter(self, lora_id: int) -> None:
        """A group admitted under adapter `lora_id` stopped running (finished, aborted or
        preempted): its pin goes (the adapter stays resident until evicted or dropped)."""
        if lora_id:
            if self.adapters is None:
                raise ValueError(f"adapter {lora_id} unpinned in a pool that holds no adapters")
            self.adapters.unpin(lora_id)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks in use stay in use; later ones cache anew)."""
        self.allocator.reset_prefix_cache()

    def take_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write block copies the worker must do before the next forward."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    # ------------------------------------------------------------------ figures
    def usage(self) -> KVUsage:
        """The pool's figures, from counters kept as blocks change (O(1))."""
        alloc = self.allocator
        # An adapter's page is one reference of its own: it is in use, not a KV block.
        held = self.adapters.held_blocks() if self.adapters is not None else 0
        return KVUsage(
            block_size=self.block_size,
            num_blocks=alloc.num_blocks,
            used_blocks=alloc.num_used_blocks - held,
            free_blocks=alloc.num_free_blocks,
            cached_blocks=alloc.num_cached_blocks,
            tokens_stored=alloc.tokens_stored,
            shared_blocks=alloc.num_shared_blocks,
            block_references=alloc.num_references - held,
            adapter_blocks=held,
        )
