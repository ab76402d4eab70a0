"""KV events of LoRA adapters' pages: the recorder's `lora_load` / `lora_evict` events
replay (kv/pool_state.py) to the manager's pool, adapter pages and static slots included,
after every step of random scheduler runs with adapters; BlockStored events carry the
adapter of blocks cached under one, whose chain a subscriber rebuilds from its root.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.cache_events import CacheEventCollector
from pagedllm.engine.kv_event_wire import BlockStored, KVEventBatch
from pagedllm.engine.kv_recorder import KVRecorder, owners_of
from pagedllm.engine.listeners import KVHooks
from pagedllm.engine.snapshot import take_snapshot
from pagedllm.entrypoints.kv_view.trace_check import check_event, check_trace
from pagedllm.kv.adapter_pages import AdapterPoolConfig
from pagedllm.kv.block_hash import hash_block, root_hash
from pagedllm.kv.manager import KVCacheManager
from pagedllm.kv.pool_state import PoolState
from pagedllm.kv.sequence_blocks import CachedPrefix
from pool_replay import pool_from_json, replay
from test_scheduler_property import simulate_adapters


class Watcher:
    """A KV recorder and a cache-event collector on a scheduler's pool (through one
    KVHooks, as the engine fans hooks out); `check` replays the recorder's events since
    the last check onto the start snapshot's pool and compares it with the manager's."""

    def __init__(self, kinds: Counter[str]) -> None:
        self.kinds = kinds
        self.records: list[dict[str, Any]] = []
        self.batches: list[KVEventBatch] = []

    def __call__(self, sched: Scheduler) -> Callable[[], None]:
        kv = sched.kv
        self.recorder = KVRecorder(
            sched, kv, self.records.append, lambda: take_snapshot(sched, kv, 0)
        )
        self.collector = CacheEventCollector(kv, self.batches.append)
        kv.set_listener(KVHooks([self.recorder, self.collector]))
        self.start = self.recorder.snapshot()
        self.state = pool_from_json(self.start["pool"])
        self.scheduler = sched
        return self.check

    def check(self) -> None:
        self.recorder.flush()
        self.collector.flush()
        events = [e for r in self.records for e in r["ev"]]
        self.records.clear()
        kv = self.scheduler.kv
        for event in events:
            check_event(event, kv.num_blocks)
            self.kinds[event["k"]] += 1
        replay(self.state, events)
        assert self.state == PoolState.of(kv, owners_of(self.scheduler))


@pytest.mark.parametrize("static", [False, True])
def test_adapter_events_replay_to_the_pool(static: bool) -> None:
    kinds: Counter[str] = Counter()
    for seed in range(6):
        watcher = Watcher(kinds)
        simulate_adapters(seed, steps=150, static=static, watch=watcher)
        check_trace({"start": watcher.start, "records": []})
        assert "lora" in watcher.start["pool"] and "slot" in watcher.start["pool"]
        # Every stored chain rebuilds from its root: the base model's or its adapter's.
        for batch in watcher.batches:
            for event in batch.events:
                if isinstance(event, BlockStored) and event.parent_block_hash is None:
                    bs = event.block_size
                    first = hash_block(root_hash(event.lora_id or 0), event.token_ids[:bs])
                    assert first == event.block_hashes[0]
    # Every adapter loaded leaves its pages by the end (the runs drop them all).
    assert kinds["lora_load"] == kinds["lora_evict"] > 0


def test_lora_events_exact() -> None:
    kv = KVCacheManager(8, 2, adapters=AdapterPoolConfig())
    batches: list[KVEventBatch] = []
    collector = CacheEventCollector(kv, batches.append)
    kv.set_listener(collector)
    assert kv.admit([0], [CachedPrefix.empty(1)], 5, lora_id=3, lora_pages=2, lora_path="/a")
    kv.cache_computed_blocks(0, [1, 2, 3, 4, 5], 5)
    assert kv.admit([1], [CachedPrefix.empty(1)], 3)
    kv.cache_computed_blocks(1, [1, 2, 3], 3)
    collector.flush()
    (batch,) = batches
    lora_chain, base_chain = batch.events
    assert isinstance(lora_chain, BlockStored) and isinstance(base_chain, BlockStored)
    assert lora_chain.lora_id == 3 and lora_chain.parent_block_hash is None
    assert lora_chain.token_ids == [1, 2, 3, 4]
    assert lora_chain.block_hashes[0] == hash_block(root_hash(3), [1, 2])
    assert base_chain.lora_id is None and base_chain.block_hashes == [hash_block(b"", [1, 2])]
    # The pool's JSON: adapter 3 in blocks 0 and 1, no static slot.
    state = PoolState.of(kv).to_json()
    assert state["lora"] == [3, 3, 0, 0, 0, 0, 0, 0] and state["slot"] == [0] * 8
    assert "lora" not in PoolState.of(KVCacheManager(8, 2)).to_json()
