"""LoRA adapters in pages of the KV pool (kv/adapter_pages.py, kv/manager.py): exact pages
for loads, evictions, pins and drops; KV allocations winning unpinned adapters' pages back;
static slots (a fixed split); the pool's figures; prefix-cache hashes keyed by adapter.
"""

from __future__ import annotations

import pytest

from inspect_internals import block_table
from pagedllm.errors import InvalidParameterError
from pagedllm.kv.adapter_pages import AdapterPoolConfig
from pagedllm.kv.block_hash import prompt_block_hashes, root_hash
from pagedllm.kv.manager import KVCacheManager
from pagedllm.kv.sequence_blocks import CachedPrefix


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, int, tuple[int, ...]]] = []

    def on_adapter_loaded(self, lora_id: int, pages: tuple[int, ...]) -> None:
        self.events.append(("load", lora_id, pages))

    def on_adapter_evicted(self, lora_id: int, pages: tuple[int, ...]) -> None:
        self.events.append(("evict", lora_id, pages))


def unified(num_blocks: int = 10, block_size: int = 4) -> tuple[KVCacheManager, Recorder]:
    kv = KVCacheManager(num_blocks, block_size, adapters=AdapterPoolConfig())
    rec = Recorder()
    assert kv.adapters is not None
    kv.adapters.listener = rec
    return kv, rec


def test_config_is_validated() -> None:
    assert AdapterPoolConfig().reserved_blocks == 0
    assert AdapterPoolConfig("static", 3, 4).reserved_blocks == 12
    with pytest.raises(InvalidParameterError) as e:
        AdapterPoolConfig("paged")
    assert e.value.param == "mode"
    with pytest.raises(InvalidParameterError) as e:
        AdapterPoolConfig("static", 0, 4)
    assert e.value.param == "static_slots"
    with pytest.raises(InvalidParameterError) as e:
        AdapterPoolConfig("static", 2, 0)
    assert e.value.param == "slot_pages"
    with pytest.raises(InvalidParameterError) as e:
        AdapterPoolConfig("unified", 2, 0)  # slots belong to static mode
    assert e.value.param == "static_slots"
    with pytest.raises(ValueError, match="leave no KV block"):
        KVCacheManager(8, 4, adapters=AdapterPoolConfig("static", 2, 4))


def test_load_pin_evict_and_reload_take_exact_pages() -> None:
    kv, rec = unified()
    ad = kv.adapters
    assert ad is not None
    assert ad.pin(1, 3, "/a1") and ad.pin(2, 2, "/a2")
    assert ad.resident[1].pages == (0, 1, 2) and ad.resident[2].pages == (3, 4)
    assert ad.pin(1, 3)  # already resident: one more pin, no load
    assert (ad.pins(1), ad.pins(2), ad.pins(3)) == (2, 1, 0)
    assert ad.num_loads == 2 and ad.held_blocks() == 5
    u = kv.usage()
    assert (u.used_blocks, u.adapter_blocks, u.free_blocks, u.block_references) == (0, 5, 5, 0)
    assert kv.num_available_blocks == 5  # every adapter pinned: nothing to win back

    # A pinned adapter is never evicted: KV fails and nothing changes.
    assert not kv.allocate_slots(100, 4 * 6)
    assert 100 not in kv.tables and ad.num_evictions == 0

    ad.unpin(1)
    ad.unpin(1)
    ad.unpin(2)  # least recently unpinned first: 1, then 2
    assert kv.num_available_blocks == 10
    # Six blocks: the five free ones are not enough, so adapter 1 (LRU) goes; its pages
    # return to the front of the free queue and KV takes them first.
    assert kv.allocate_slots(100, 4 * 6)
    assert block_table(kv, 100).blocks == [0, 1, 2, 5, 6, 7]
    assert set(ad.resident) == {2} and ad.num_evictions == 1
    u = kv.usage()
    assert (u.used_blocks, u.adapter_blocks, u.free_blocks, u.block_references) == (6, 2, 2, 6)

    # Reloading adapter 1 evicts adapter 2 and takes its pages, then a free one.
    assert ad.pin(1, 3, "/a1")
    assert ad.resident[1].pages == (3, 4, 8)
    assert set(ad.resident) == {1} and ad.num_loads == 3 and ad.num_evictions == 2
    assert rec.events == [
        ("load", 1, (0, 1, 2)),
        ("load", 2, (3, 4)),
        ("evict", 1, (0, 1, 2)),
        ("evict", 2, (3, 4)),
        ("load", 1, (3, 4, 8)),
    ]
    # Too big for what is free and evictable: no change.
    assert not ad.pin(3, 2)
    assert set(ad.resident) == {1} and ad.num_evictions == 2
    ad.unpin(1)
    kv.free(100)
    ad.drop(1)
    assert kv.num_free_blocks == 10 and not ad.resident and ad.held_blocks() == 0
    with pytest.raises(ValueError, match="not pinned"):
        ad.unpin(1)


def test_drop_is_deferred_while_pinned() -> None:
    kv, rec = unified()
    ad = kv.adapters
    assert ad is not None
    assert ad.pin(7, 2, "/a7") and ad.pin(7, 2)
    ad.drop(7)
    assert ad.resident[7].pages == (0, 1)  # two requests still run under it
    ad.unpin(7)
    assert 7 in ad.resident
    ad.unpin(7)  # the last: its pages go now, not to the LRU
    assert 7 not in ad.resident and kv.num_free_blocks == 10
    # A request under it admitted later (one preempted before the drop) loads it again,
    # and it goes at that request's end.
    assert ad.pin(7, 2, "/a7")
    assert ad.resident[7].pages == (0, 1)
    ad.unpin(7)
    assert not ad.resident and kv.num_free_blocks == 10
    assert ad.num_evictions == 0 and ad.num_loads == 2
    assert rec.events == [
        ("load", 7, (0, 1)),
        ("evict", 7, (0, 1)),
        ("load", 7, (0, 1)),
        ("evict", 7, (0, 1)),
    ]
    ad.drop(99)  # an adapter never loaded: nothing to free


def test_admission_counts_pins_and_evicts_adapter_pages() -> None:
    """`admit` under an adapter is all or nothing over the adapter's pages and the KV
    blocks, unpinned adapters counted as free; the hit blocks are taken first."""
    kv, rec = unified(num_blocks=8)
    ad = kv.adapters
    assert ad is not None
    empty = [CachedPrefix.empty(1)]
    # 4 KV blocks + 5 pages > 8: refused, nothing taken.
    assert not kv.admit([0], empty, 16, lora_id=1, lora_pages=5, lora_path="/a1")
    assert not ad.resident and not kv.tables and kv.num_free_blocks == 8
    assert kv.admit([0], empty, 12, lora_id=1, lora_pages=5, lora_path="/a1")
    assert ad.resident[1].pages == (0, 1, 2, 3, 4) and ad.pins(1) == 1
    assert block_table(kv, 0).blocks == [5, 6, 7]
    assert kv.tables[0].lora_id == 1
    kv.free(0)
    kv.unpin_adapter(1)
    # Adapter 2 (4 pages) and 2 KV blocks: adapter 1 (unpinned) is evicted for them.
    assert kv.admit([1], empty, 8, lora_id=2, lora_pages=4, lora_path="/a2")
    assert ad.resident[2].pages == (0, 1, 2, 3)
    assert block_table(kv, 1).blocks == [4, 5]
    assert rec.events == [
        ("load", 1, (0, 1, 2, 3, 4)),
        ("evict", 1, (0, 1, 2, 3, 4)),
        ("load", 2, (0, 1, 2, 3)),
    ]
    # The watermark counts unpinned adapters' pages as free, without evicting them.
    kv.free(1)
    kv.unpin_adapter(2)
    wm = KVCacheManager(8, 4, watermark_blocks=2, adapters=AdapterPoolConfig())
    assert wm.admit([0], empty, 4, lora_id=3, lora_pages=5, lora_path="/a3")
    assert not wm.admit([1], empty, 4, keep_watermark=True)  # 5 + 1 + 1 + 2 > 8
    wm.unpin_adapter(3)
    assert wm.admit([1], empty, 8, keep_watermark=True)  # 1 + 2 + 2 <= 2 free + 5 pages
    assert wm.adapters is not None and 3 in wm.adapters.resident
    with pytest.raises(InvalidParameterError) as e:  # an adapter takes a page at least
        kv.admit([5], empty, 4, lora_id=6, lora_pages=0, lora_path="/a6")
    assert e.value.param == "lora_pages" and 5 not in kv.tables and 6 not in ad.resident
    with pytest.raises(ValueError, match="holds no adapters"):
        KVCacheManager(8, 4).admit([0], empty, 4, lora_id=1, lora_pages=1)


def test_static_slots_are_a_fixed_split() -> None:
    kv = KVCacheManager(10, 4, adapters=AdapterPoolConfig("static", 2, 3))
    ad = kv.adapters
    assert ad is not None
    rec = Recorder()
    ad.listener = rec
    u = kv.usage()
    assert (u.used_blocks, u.adapter_blocks, u.free_blocks) == (0, 6, 4)
    assert kv.num_kv_blocks == 4 and kv.num_available_blocks == 4
    assert ad.pin(1, 2, "/a1") and ad.pin(2, 3, "/a2")
    assert ad.resident[1].pages == (0, 1) and ad.resident[2].pages == (3, 4, 5)
    assert ad.held_blocks() == 6 and kv.usage().free_blocks == 4
    assert not ad.pin(3, 1, "/a3")  # both slots pinned: it waits
    ad.unpin(1)
    assert ad.pin(3, 1, "/a3")  # the unpinned adapter leaves its slot
    assert ad.resident[3].pages == (0,) and 1 not in ad.resident
    assert ad.num_evictions == 1 and ad.num_loads == 3
    ad.unpin(3)
    # KV gets the rest and never evicts an adapter from its slot.
    assert kv.allocate_slots(0, 16)
    assert block_table(kv, 0).blocks == [6, 7, 8, 9]
    assert not kv.allocate_slots(0, 17)
    assert 3 in ad.resident
    with pytest.raises(InvalidParameterError) as e:
        ad.pin(4, 4, "/a4")
    assert e.value.param == "lora_pages"
    ad.drop(3)
    ad.unpin(2)
    ad.drop(2)
    kv.free(0)
    assert not ad.resident and kv.num_free_blocks == 4 and ad.held_blocks() == 6
    assert rec.events == [
        ("load", 1, (0, 1)),
        ("load", 2, (3, 4, 5)),
        ("evict", 1, (0, 1)),
        ("load", 3, (0,)),
        ("evict", 3, (0,)),
        ("evict", 2, (3, 4, 5)),
    ]


def test_prefix_cache_is_keyed_by_adapter() -> None:
    """Same prompt under two adapters: no hit; under the same adapter (or the base model
    twice): a hit. The chain's root is the adapter's."""
    kv, _ = unified(num_blocks=20)
    prompt = list(range(1, 10))  # two full reusable blocks of 4
    empty = [CachedPrefix.empty(1)]
    for seq_id, lora in enumerate((0, 1)):
        assert kv.admit([seq_id], empty, 9, lora_id=lora, lora_pages=2, lora_path="/a")
        kv.cache_computed_blocks(seq_id, prompt, 9)
    base_blocks = block_table(kv, 0).blocks[:2]
    lora_blocks = block_table(kv, 1).blocks[:2]
    assert kv.allocator.cached_info(lora_blocks[0]).parent_hash == root_hash(1)  # type: ignore[union-attr]
    assert kv.allocator.cached_info(lora_blocks[0]).lora_id == 1  # type: ignore[union-attr]
    assert kv.allocator.cached_info(base_blocks[0]).parent_hash == b""  # type: ignore[union-attr]
    hit = {lora: kv.lookup_prefix([prompt], lora_id=lora)[0] for lora in (0, 1, 2)}
    assert list(hit[0].tables[0]) == base_blocks
    assert list(hit[1].tables[0]) == lora_blocks
    assert hit[2].num_blocks == 0
    assert hit[0].hashes == tuple(prompt_block_hashes(prompt, 4))
    assert hit[1].hashes == tuple(prompt_block_hashes(prompt, 4, lora_id=1))
    assert set(hit[0].hashes).isdisjoint(hit[1].hashes)
    # A fork keeps its parent's adapter: the blocks it computes chain under it too.
    kv.fork(1, 5)
    assert kv.tables[5].lora_id == 1
    assert root_hash(0) == b"" and root_hash(1) != root_hash(2)
