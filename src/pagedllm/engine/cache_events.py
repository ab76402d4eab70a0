"""CacheEventCollector: the prefix cache's changes of each step, as KV-event batches.

A step listener that hears the allocator's hooks (kv/events.py) and turns them into the
wire events of engine/kv_event_wire.py: a block joining the cache is a BlockStored (with
its hash, its parent's and its tokens, read from the allocator at once; consecutive
blocks of one chain share one event, as vLLM sends them), a cached block reused for
other content a BlockRemoved, a reset AllBlocksCleared. In a model of several layer
groups (kv/groups.py) the events describe the first group's blocks: the hashes are the
same in every group, and a router asks which prefix an engine holds. At the end of each
step (and before the next one, for what happened between steps) the events go out as one
batch to `publish`, which must not block (KVEventPublisher queues it for its own thread).
Cheap on the engine's thread: a dict update and a list append per cached block.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.engine.kv_event_wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventBatch,
)
from pagedllm.engine.listeners import StepListener
from pagedllm.engine.outputs import RequestOutput
from pagedllm.engine.snapshot import EngineSnapshot
from pagedllm.kv.block_hash import root_hash
from pagedllm.kv.events import TableView
from pagedllm.kv.manager import KVCacheManager


class CacheEventCollector(StepListener):
    wants_kv_events = True

    def __init__(self, kv: KVCacheManager, publish: Callable[[KVEventBatch], None]) -> None:
        """Registered by the engine (`add_listener`). Blocks cached already when it starts
        go out first, each as a BlockStored, so a subscriber starts from the whole cache."""
        self.allocator = kv.allocator
        self.block_size = kv.block_size
        self.publish = publish
        self._events: list[KVCacheEvent] = []
        # Hash of each cached block: the allocator forgets it before telling of an eviction.
        self._hash_of: dict[int, bytes] = {}
        for block in range(self.allocator.num_blocks):
            if self.allocator.cached_info(block) is not None:
                self.on_cached(block)

    # --------------------------------------------------------- the step loop
    def on_step_begin(self, step_number: int) -> None:
        self.flush()

    def on_step_end(
        self, step: SchedulerOutput, outputs: Sequence[RequestOutput], ran: EngineSnapshot
    ) -> None:
        self.flush()

    def flush(self) -> None:
        """Hand `publish` the events gathered since the last batch, if any."""
        if self._events:
            events, self._events = self._events, []
            self.publish(KVEventBatch(ts=time.time(), events=events))

    # ------------------------------------------------- the allocator's hooks
    def on_cached(self, block: int) -> None:
        info = self.allocator.cached_info(block)
        if info is None or info.group != 0:
            return
        self._hash_of[block] = info.block_hash
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockStored) and last.block_hashes[-1] == info.parent_hash:
            last.block_hashes.append(info.block_hash)
            last.token_ids.extend(info.token_ids)
            return
        # A chain's first block: its parent is the root, b"" or its adapter's (sent nil).
        first = info.parent_hash == root_hash(info.lora_id)
        self._events.append(
            BlockStored(
                block_hashes=[info.block_hash],
                parent_block_hash=None if first else info.parent_hash,
                token_ids=list(info.token_ids),
                block_size=self.block_size,
                lora_id=info.lora_id or None,
                medium=None,
                lora_name=None,
            )
        )

    def on_evicted(self, block: int) -> None:
        block_hash = self._hash_of.pop(block, None)
        if block_hash is None:
            return
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(block_hash)
        else:
            self._events.append(BlockRemoved(block_hashes=[block_hash], medium=None))

    def on_cache_reset(self) -> None:
        self._hash_of.clear()
        self._events.append(AllBlocksCleared())

    # ------------------------------ adapters' pages hold no cached prefix
    def on_adapter_loaded(self, lora_id: int, pages: tuple[int, ...]) -> None:
        pass

    def on_adapter_evicted(self, lora_id: int, pages: tuple[int, ...]) -> None:
        pass

    # ------------------------------- the manager's hooks: tables say nothing here
    def on_admitted(self, seq_id: int, table: TableView, num_hits: int, group: int = 0) -> None:
        pass

    def on_grown(
        self, seq_id: int, table: TableView, copies: list[tuple[int, int]], group: int = 0
    ) -> None:
        pass

    def on_forked(self, parent_id: int, child_id: int, table: TableView, group: int = 0) -> None:
        pass

    def on_freed(self, seq_id: int, table: TableView, group: int = 0) -> None:
        pass

    def on_dropped(
        self, seq_id: int, table: TableView, dropped: list[tuple[int, int]], group: int = 0
    ) -> None:
        pass

    def on_trimmed(
        self, seq_id: int, table: TableView, given_back: list[int], lookahead: int, group: int = 0
    ) -> None:
        pass
