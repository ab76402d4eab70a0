"""KV events: what the block bookkeeping tells a listener, and the events a listener makes.

The allocator and the manager each hold a `listener` that stays None unless someone
watches the pool (the KV view of the server, a `--kv-trace` of an offline run). A hook
is one `if self.listener is not None:` after an operation has succeeded, so an engine
nobody watches tests one attribute per operation and builds nothing. Hooks hand over
live objects (a block table, a block id); the listener copies what it needs at once.

A listener turns the hooks into events: plain JSON-ready dicts, `{"k": kind, ...}`, with
exactly the fields `EVENT_FIELDS` below names for their kind, where it also says what
each kind means. Replaying them in order from the pool they started from gives the pool
exactly (kv/pool_state.py does it in Python, the KV view's script in the browser, and
the trace checker of entrypoints/kv_view checks a file's events against the same table).
A model with several layer groups (kv/groups.py) has one table per sequence and group:
the table events of group g > 0 carry `"g": g` too (none: group 0, the only group of a
model of one kind).

LoRA adapters' pages (kv/adapter_pages.py) come and go with `lora_load` / `lora_evict`.

Events of one engine step are grouped in a record `{"step": n, "ev": [...], "st": {...}}`
with the step's figures in `st` (engine/kv_recorder.py).
"""

from __future__ import annotations

from typing import Any, Protocol

Event = dict[str, Any]

# Each kind's fields (besides "k", and "g" on a table event of a layer group g > 0), each
# with the rule its value follows: id, a sequence id; req, a request id (or None); count,
# a whole number; block, a pool block id; blocks, pool block ids; entries, a table's
# entries (pool block ids, or -1 for the null block behind a window); text, a string.
EVENT_FIELDS: dict[str, dict[str, str]] = {
    # `blocks` (fresh, reference count 1) join the end of seq's table, which now claims
    # `tokens` slots; a seq not seen before starts a table.
    "alloc": {"seq": "id", "req": "req", "blocks": "blocks", "tokens": "count"},
    # The table claims more slots in blocks it has.
    "append": {"seq": "id", "req": "req", "tokens": "count"},
    # A new table starts with these prefix-cached blocks (reference counts +1); an
    # `alloc` follows.
    "hit": {"seq": "id", "req": "req", "blocks": "entries"},
    # Copy-on-write: logical block `index` moves from the shared `src` to the fresh `dst`.
    "cow": {"seq": "id", "req": "req", "index": "count", "src": "block", "dst": "block"},
    # A new table sharing every block of `parent`'s.
    "fork": {"seq": "id", "req": "req", "parent": "id"},
    # The table is gone (reference counts -1).
    "free": {"seq": "id", "req": "req", "blocks": "entries"},
    # A table of a kind that gives blocks back (a sliding window) gave back `blocks`: its
    # entries before `upto` are now the null block (reference counts -1).
    "drop": {"seq": "id", "req": "req", "upto": "count", "blocks": "blocks"},
    # A check of proposals ended (speculative decoding): the table had claimed `la`
    # lookahead slots for them, its last ones; it now claims `tokens` slots (the kept
    # proposals'), and `blocks`, which held only rejected proposals, left its end for
    # the pool (reference counts -1).
    "trim": {"seq": "id", "req": "req", "tokens": "count", "blocks": "blocks", "la": "count"},
    # The block's full content joins the prefix cache.
    "cache": {"block": "block"},
    # A cached free block is reused: its entry is gone.
    "evict": {"block": "block"},
    # The prefix cache forgot every entry.
    "reset": {},
    # The request's tables were freed to make room; it waits to be recomputed.
    "preempt": {"req": "req"},
    # The request ended (all its sequences done).
    "finish": {"req": "req"},
    # The request was aborted.
    "abort": {"req": "req"},
    # (Only when text is asked for) the block's tokens.
    "text": {"block": "block", "text": "text"},
    # LoRA adapter `lora` now holds `blocks` (its pages, in the order its weights fill
    # them): fresh blocks (reference count 1), or pages of a static slot (reserved for
    # adapters from the start, reference count 1 throughout).
    "lora_load": {"lora": "id", "blocks": "blocks"},
    # The adapter left its pages (evicted for room, or dropped): fresh ones go back to
    # the pool (reference count 0), a static slot's stay reserved for the next adapter.
    "lora_evict": {"lora": "id", "blocks": "blocks"},
}


class TableView(Protocol):
    """What a listener reads of a block table (kv/block_table.py's BlockTable)."""

    blocks: list[int]
    num_tokens: int


class PoolListener(Protocol):
    """Hooks of the allocator: the prefix cache's entries come and go."""

    def on_cached(self, block: int) -> None: ...

    def on_evicted(self, block: int) -> None: ...

    def on_cache_reset(self) -> None: ...


class AdapterListener(Protocol):
    """Hooks of LoRA adapters' residency in pool pages (kv/adapter_pages.py)."""

    def on_adapter_loaded(self, lora_id: int, pages: tuple[int, ...]) -> None: ...

    def on_adapter_evicted(self, lora_id: int, pages: tuple[int, ...]) -> None: ...


class KVListener(PoolListener, AdapterListener, Protocol):
    """Hooks of the manager: block tables start, grow, fork and go; `group` is the layer
    group the table belongs to (0 in a model of one kind)."""

    def on_admitted(self, seq_id: int, table: TableView, num_hits: int, group: int = 0) -> None:
        """A new table: its first `num_hits` blocks are prefix-cache hits, the rest new."""
        ...

    def on_grown(
        self, seq_id: int, table: TableView, copies: list[tuple[int, int]], group: int = 0
    ) -> None:
        """The table claims more slots, after `copies` (copy-on-write (src, dst))."""
        ...

    def on_forked(
        self, parent_id: int, child_id: int, table: TableView, group: int = 0
    ) -> None: ...

    def on_freed(self, seq_id: int, table: TableView, group: int = 0) -> None:
        """Called before the table lets go of its blocks."""
        ...

    def on_dropped(
        self, seq_id: int, table: TableView, dropped: list[tuple[int, int]], group: int = 0
    ) -> None:
        """A window group's table gave back `dropped` ((index, block) pairs): those
        entries are now the null block."""
        ...

    def on_trimmed(
        self, seq_id: int, table: TableView, given_back: list[int], lookahead: int, group: int = 0
    ) -> None:
        """Proposals were checked: the table, whose last `lookahead` slots were claimed
        for them, now claims only the kept ones; `given_back` blocks (the table's last,
        holding only rejected proposals) went back to the pool."""
        ...
