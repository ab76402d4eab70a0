"""KV events replayed in tests: a PoolState read back from its JSON form (a snapshot's or
a trace's start), and events applied to one in order."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from pagedllm.kv.events import Event
from pagedllm.kv.pool_state import PoolState, TableState


def pool_from_json(data: Mapping[str, Any]) -> PoolState:
    """The inverse of `PoolState.to_json` (fill and owners are derived again)."""
    state = PoolState(int(data["num_blocks"]), int(data["block_size"]))
    state.ref = [int(r) for r in data["ref"]]
    state.cached = [bool(c) for c in data["cached"]]
    if "lora" in data:  # a pool with LoRA adapters' pages
        state.has_adapters = True
        state.lora = [int(x) for x in data["lora"]]
        state.slot = [bool(x) for x in data["slot"]]
    state.tables = {
        (int(t["seq"]), int(t.get("g", 0))): TableState(
            t["req"], [int(b) for b in t["blocks"]], int(t["tokens"])
        )
        for t in data["seqs"]
    }
    return state


def replay(state: PoolState, events: Iterable[Event]) -> PoolState:
    for event in events:
        state.apply(event)
    return state
