"""PoolState: a plain copy of the pool, read from a manager or rebuilt from KV events.

It holds what the KV view draws: each physical block's reference count and whether it
is prefix-cached, each live table (its request, blocks and claimed slots), and, derived
from the tables, each block's fill and owners. `PoolState.of(manager)` reads a manager;
`apply(event)` replays one event (kv/events.py `EVENT_FIELDS`), so replaying a run's events from the
state it started in must give `PoolState.of` the manager at the end: the tests check
exactly that, and the page's script replays the same way. Tables are keyed by
(sequence, layer group); an entry given back behind a window is -1. With LoRA adapters
in the pool, `lora` names the adapter holding each block (0: none) and `slot` marks the
pages of static adapter slots (reserved for adapters from the start).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pagedllm.kv.events import Event
from pagedllm.kv.manager import KVCacheManager


@dataclass
class TableState:
    req: str | None
    blocks: list[int] = field(default_factory=list)
    tokens: int = 0


class PoolState:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref = [0] * num_blocks
        self.cached = [False] * num_blocks
        self.tables: dict[tuple[int, int], TableState] = {}  # (seq, group) -> table
        self.has_adapters = False  # the pool holds LoRA adapters' pages (the JSON says so)
        self.lora = [0] * num_blocks  # the adapter whose pages each block is (0: none)
        self.slot = [False] * num_blocks  # a static adapter slot's page

    @classmethod
    def of(cls, kv: KVCacheManager, owners: Mapping[int, str] | None = None) -> PoolState:
        """The manager's pool now; `owners` maps sequence ids to request ids."""
        owners = owners or {}
        state = cls(kv.num_blocks, kv.block_size)
        alloc = kv.allocator
        state.ref = [alloc.ref_count(b) for b in range(kv.num_blocks)]
        state.cached = [alloc.cached_info(b) is not None for b in range(kv.num_blocks)]
        null = kv.null_block
        state.tables = {
            (seq_id, g): TableState(
                owners.get(seq_id), [-1 if b == null else b for b in t.blocks], t.num_tokens
            )
            for seq_id, seq in kv.tables.items()
            for g, t in enumerate(seq.groups)
        }
        if kv.adapters is not None:
            state.has_adapters = True
            for page in kv.adapters.reserved_pages():
                state.slot[page] = True
            for lora_id, adapter in kv.adapters.resident.items():
                for page in adapter.pages:
                    state.lora[page] = lora_id
        return state

    # ------------------------------------------------------------------ replay
    def apply(self, event: Event) -> None:
        """Replay one event (kv/events.py `EVENT_FIELDS` says what each kind means)."""
        kind = event["k"]
        key = (event.get("seq"), event.get("g", 0))
        if kind == "alloc":
            table = self.tables.setdefault(key, TableState(event.get("req")))
            for block in event["blocks"]:
                self.ref[block] = 1
            table.blocks.extend(event["blocks"])
            table.tokens = event["tokens"]
        elif kind == "append":
            self.tables[key].tokens = event["tokens"]
        elif kind == "hit":
            blocks = list(event["blocks"])
            for block in blocks:
                if block >= 0:
                    self.ref[block] += 1
            self.tables[key] = TableState(event.get("req"), blocks, len(blocks) * self.block_size)
        elif kind == "cow":
            table = self.tables[key]
            self.ref[event["src"]] -= 1
            self.ref[event["dst"]] = 1
            table.blocks[event["index"]] = event["dst"]
        elif kind == "fork":
            parent = self.tables[event["parent"], key[1]]
            for block in parent.blocks:
                if block >= 0:
                    self.ref[block] += 1
            self.tables[key] = TableState(event.get("req"), list(parent.blocks), parent.tokens)
        elif kind == "free":
            table = self.tables.pop(key)
            for block in table.blocks:
                if block >= 0:
                    self.ref[block] -= 1
        elif kind == "drop":
            table = self.tables[key]
            for block in event["blocks"]:
                self.ref[block] -= 1
            table.blocks[: event["upto"]] = [-1] * event["upto"]
        elif kind == "trim":
            table = self.tables[key]
            given = event["blocks"]
            for block in given:
                self.ref[block] -= 1
            # The blocks given back are the table's last ones.
            del table.blocks[len(table.blocks) - len(given) :]
            table.tokens = event["tokens"]
        elif kind == "cache":
            self.cached[event["block"]] = True
        elif kind == "evict":
            self.cached[event["block"]] = False
        elif kind == "reset":
            self.cached = [False] * self.num_blocks
        elif kind == "lora_load":
            for block in event["blocks"]:
                self.ref[block] = 1
                self.lora[block] = event["lora"]
        elif kind == "lora_evict":
            for block in event["blocks"]:
                self.ref[block] = int(self.slot[block])
                self.lora[block] = 0
        # preempt, finish, abort and text change no block.

    # ----------------------------------------------------------------- derived
    def fill(self) -> list[int]:
        """Tokens in each block: the most any table holding it has claimed there (as
        KVCacheManager.usage() counts them); 0 for a free block."""
        bs = self.block_size
        filled = [0] * self.num_blocks
        for table in self.tables.values():
            for i, block in enumerate(table.blocks):
                n = min(bs, max(0, table.tokens - i * bs))
                if block >= 0 and n > filled[block]:
                    filled[block] = n
        return filled

    def owners(self) -> list[list[str]]:
        """The requests holding each block, in the order their tables were made."""
        owners: list[list[str]] = [[] for _ in range(self.num_blocks)]
        for table in self.tables.values():
            if table.req is None:
                continue
            for block in table.blocks:
                if block >= 0 and table.req not in owners[block]:
                    owners[block].append(table.req)
        return owners

    def to_json(self) -> dict[str, Any]:
        """Per block (columns): reference count, cached, tokens filled, owner requests;
        per live sequence: its request, block table (logical -> physical) and slots."""
        return {
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "ref": list(self.ref),
            "cached": [int(c) for c in self.cached],
            "fill": self.fill(),
            "owners": self.owners(),
            **(
                {"lora": list(self.lora), "slot": [int(s) for s in self.slot]}
                if self.has_adapters
                else {}
            ),
            "seqs": [
                {
                    "seq": seq_id,
                    "req": t.req,
                    **({"g": g} if g else {}),
                    "blocks": list(t.blocks),
                    "tokens": t.tokens,
                }
                for (seq_id, g), t in sorted(self.tables.items())
            ],
        }

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PoolState):
            return NotImplemented
        return (
            self.num_blocks == other.num_blocks
            and self.block_size == other.block_size
            and self.ref == other.ref
            and self.cached == other.cached
            and self.tables == other.tables
            and self.lora == other.lora
            and self.slot == other.slot
        )

    __hash__ = None  # type: ignore[assignment]  # mutable
