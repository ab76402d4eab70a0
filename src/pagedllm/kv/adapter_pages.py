"""AdapterPages: LoRA adapters resident in pages of the KV block pool (S-LoRA's unified paging).

An adapter takes whole pool blocks ("pages") from the same allocator as the KV blocks.
It is loaded (its pages taken) when a request that runs under it is admitted, pinned
while such requests run (each request holds one pin, whatever its sequence count), and
stays resident unpinned afterwards, in least-recently-unpinned order, until the pool
needs its pages: for KV blocks (the manager evicts before it fails an allocation, so KV
wins memory back before anything is preempted) or for another adapter.

`mode="static"` is the baseline of fixed slots (vLLM's): `static_slots` slots of
`slot_pages` pages each are taken out of the pool for good when the pool starts (KV gets
the rest); an adapter occupies a whole slot, its pages the slot's first ones; with no
free slot and none unpinned, a request under a new adapter waits. KV never evicts one.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

from pagedllm.errors import InvalidParameterError
from pagedllm.kv.allocator import BlockAllocator
from pagedllm.kv.events import AdapterListener
from pagedllm.validation import check_int

ADAPTER_MODES = ("unified", "static")


@dataclass(frozen=True)
class AdapterPoolConfig:
    """How adapters share the pool: `unified` pages, or `static` slots reserved up front."""

    mode: str = "unified"
    static_slots: int = 0  # static: how many adapters may be resident at once
    slot_pages: int = 0  # static: pages of one slot (an adapter of max rank on every target)

    def __post_init__(self) -> None:
        if self.mode not in ADAPTER_MODES:
            raise InvalidParameterError(
                "mode", f"mode must be one of {', '.join(ADAPTER_MODES)}; got {self.mode!r}"
            )
        low = 1 if self.mode == "static" else 0
        high = None if self.mode == "static" else 0
        for name in ("static_slots", "slot_pages"):
            check_int(getattr(self, name), name, min=low, max=high, subject=f"{self.mode} mode")

    @property
    def reserved_blocks(self) -> int:
        """Blocks taken out of the pool for good when it starts."""
        return self.static_slots * self.slot_pages


@dataclass(frozen=True)
class ResidentAdapter:
    """An adapter in the pool: its pages (in the order its weights fill them), its pins."""

    pages: tuple[int, ...]
    pins: int = 0
    path: str | None = None
    slot: int | None = None  # static mode: the slot it occupies


class AdapterPages:
    def __init__(self, allocator: BlockAllocator, config: AdapterPoolConfig) -> None:
        """Static mode takes its slots' blocks from `allocator` now (a fresh pool gives
        blocks 0..reserved-1)."""
        self.allocator = allocator
        self.config = config
        self.static = config.mode == "static"
        self._resident: dict[int, ResidentAdapter] = {}
        # Resident, unpinned adapters; the least recently unpinned first (evicted first).
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._dropped: set[int] = set()  # forgotten: freed at their last unpin
        self._slots: list[tuple[int, ...]] = []
        self._free_slots: list[int] = []
        if self.static:
            if config.reserved_blocks >= allocator.num_free_blocks:
                raise InvalidParameterError(
                    "static_slots",
                    f"{config.static_slots} adapter slots of {config.slot_pages} pages take "
                    f"{config.reserved_blocks} blocks; the pool has {allocator.num_free_blocks}"
                    " free and KV needs some",
                )
            reserve = allocator.allocate_many(config.reserved_blocks)
            p = config.slot_pages
            self._slots = [tuple(reserve[i * p : (i + 1) * p]) for i in range(config.static_slots)]
            self._free_slots = list(range(config.static_slots))
        self.num_loads = 0
        self.num_evictions = 0
        self.listener: AdapterListener | None = None

    # ----------------------------------------------------------------- queries
    @property
    def resident(self) -> Mapping[int, ResidentAdapter]:
        return self._resident

    def reserved_pages(self) -> tuple[int, ...]:
        """Static mode: every slot's pages, slot after slot (unified mode: none)."""
        return tuple(page for slot in self._slots for page in slot)

    def pins(self, lora_id: int) -> int:
        adapter = self._resident.get(lora_id)
        return adapter.pins if adapter is not None else 0

    def held_blocks(self) -> int:
        """Blocks adapters hold: resident pages, or in static mode the whole reserve."""
        if self.static:
            return self.config.reserved_blocks
        return sum(len(a.pages) for a in self._resident.values())

    def evictable_blocks(self, keep: int = 0) -> int:
        """Pages KV could win back now by evicting unpinned adapters (none in static mode:
        the slots are the adapters' for good); adapter `keep` is not counted."""
        if self.static:
            return 0
        return sum(len(self._resident[i].pages) for i in self._lru if i != keep)

    def pages_to_load(self, lora_id: int, num_pages: int) -> int:
        """Blocks pinning the adapter would take from the pool's free blocks now."""
        if lora_id in self._resident or self.static:
            return 0
        return num_pages

    def can_pin(self, lora_id: int, num_pages: int, free_blocks: int) -> bool:
        """Whether `pin` would succeed with `free_blocks` free blocks left to it."""
        if lora_id in self._resident:
            return True
        if self.static:
            self._check_slot_size(num_pages)
            return bool(self._free_slots or self._lru)
        return num_pages <= free_blocks + self.evictable_blocks()

    # -------------------------------------------------------------- residency
    def pin(self, lora_id: int, num_pages: int, path: str | None = None) -> bool:
        """One more request runs under the adapter: load it if it is not resident (taking
        `num_pages` pages, evicting unpinned adapters least recently used first if the
        free blocks do not suffice). All or nothing: False and no change if it cannot."""
        check_int(lora_id, "lora_id", min=1)
        adapter = self._resident.get(lora_id)
        if adapter is None:
            if not self.can_pin(lora_id, num_pages, self.allocator.num_free_blocks):
                return False
            adapter = self._load(lora_id, num_pages, path)
        else:
            self._lru.pop(lora_id, None)
        self._resident[lora_id] = ResidentAdapter(
            adapter.pages, adapter.pins + 1, adapter.path, adapter.slot
        )
        return True

    def unpin(self, lora_id: int) -> None:
        """A request under the adapter stopped running (finished, aborted, preempted)."""
        adapter = self._resident.get(lora_id)
        if adapter is None or adapter.pins == 0:
            raise ValueError(f"adapter {lora_id} is not pinned")
        adapter = ResidentAdapter(adapter.pages, adapter.pins - 1, adapter.path, adapter.slot)
        self._resident[lora_id] = adapter
        if adapter.pins == 0:
            if lora_id in self._dropped:
                self._release(lora_id)
            else:
                self._lru[lora_id] = None

    def drop(self, lora_id: int) -> None:
        """Forget the adapter: its pages are freed now, or at its last unpin if requests
        run under it. A request under it admitted later (one preempted before) loads it
        again, and it goes at that request's end too."""
        self._dropped.add(lora_id)
        adapter = self._resident.get(lora_id)
        if adapter is not None and adapter.pins == 0:
            self._lru.pop(lora_id, None)
            self._release(lora_id)

    def evict(self, lora_id: int) -> bool:
        """Evict the adapter now if it is resident and unpinned (its pages may not hold its
        weights: the step that was to write them failed); False if it is not."""
        if lora_id not in self._lru:
            return False
        del self._lru[lora_id]
        self.num_evictions += 1
        self._release(lora_id)
        return True

    def evict_for(self, num_blocks: int) -> bool:
        """Evict unpinned adapters, least recently used first, until the allocator has
        `num_blocks` free blocks; all or nothing: False and no eviction if it cannot."""
        free = self.allocator.num_free_blocks
        if free >= num_blocks:
            return True
        if free + self.evictable_blocks() < num_blocks:
            return False
        while self.allocator.num_free_blocks < num_blocks:
            self._evict_lru()
        return True

    # ---------------------------------------------------------------- helpers
    def _load(self, lora_id: int, num_pages: int, path: str | None) -> ResidentAdapter:
        check_int(num_pages, "lora_pages", min=1)
        if self.static:
            if not self._free_slots:
                self._evict_lru()
            slot = self._free_slots.pop(0)
            pages = self._slots[slot][:num_pages]
        else:
            slot = None
            while self.allocator.num_free_blocks < num_pages:
                self._evict_lru()
            pages = tuple(self.allocator.allocate_many(num_pages))
        adapter = ResidentAdapter(pages, 0, path, slot)
        self._resident[lora_id] = adapter
        self.num_loads += 1
        if self.listener is not None:
            self.listener.on_adapter_loaded(lora_id, pages)
        return adapter

    def _evict_lru(self) -> None:
        lora_id, _ = self._lru.popitem(last=False)
        self.num_evictions += 1
        self._release(lora_id)

    def _release(self, lora_id: int) -> None:
        """Give the (unpinned) adapter's pages back: to the pool, or its static slot."""
        adapter = self._resident.pop(lora_id)
        if self.static:
            assert adapter.slot is not None
            self._free_slots.append(adapter.slot)
            self._free_slots.sort()
        else:
            for page in reversed(adapter.pages):
                self.allocator.free(page)
        if self.listener is not None:
            self.listener.on_adapter_evicted(lora_id, adapter.pages)

    def _check_slot_size(self, num_pages: int) -> None:
        if num_pages > self.config.slot_pages:
            raise InvalidParameterError(
                "lora_pages",
                f"an adapter of {num_pages} pages does not fit a static slot of "
                f"{self.config.slot_pages} pages",
            )
