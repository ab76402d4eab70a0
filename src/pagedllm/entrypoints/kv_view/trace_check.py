"""`check_trace`: every value of a KV trace that the replay page draws has the type the
page expects, so that a crafted or damaged file is refused with the field named
(`records[3].st.used must be a number, got 'x'`) instead of being drawn.

`load_trace` (engine/kv_trace.py) checks the file's format and version; this checks the
contents: the start snapshot's pool and figures, each record's step and figures, and
each event's fields by kind, by the rules of kv/events.py's `EVENT_FIELDS`. Block ids
must lie in the pool; a table's entries may also be -1 (the null block behind a sliding
window), and table events of a layer group other than the first carry its index `g`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from pagedllm.kv.events import EVENT_FIELDS
from pagedllm.validation import is_int, shown

_POOL_LISTS = ("ref", "cached", "fill")
_ADAPTER_LISTS = ("lora", "slot")  # a pool with LoRA adapters' pages only


class _Checker:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks

    def id(self, value: Any, where: str) -> None:
        if not is_int(value) or value < 0:
            raise ValueError(f"{where} must be a whole number >= 0, got {shown(value)}")

    count = id  # token counts and indexes: the same rule as ids

    def block(self, value: Any, where: str) -> None:
        if not is_int(value) or not 0 <= value < self.num_blocks:
            raise ValueError(
                f"{where} must be a block id in [0, {self.num_blocks}), got {shown(value)}"
            )

    def blocks(self, value: Any, where: str) -> None:
        for i, block in enumerate(_list(value, where)):
            self.block(block, f"{where}[{i}]")

    def entries(self, value: Any, where: str) -> None:
        """A table's entries: block ids, or -1 for the null block."""
        for i, block in enumerate(_list(value, where)):
            if block != -1:
                self.block(block, f"{where}[{i}]")

    def req(self, value: Any, where: str) -> None:
        if value is not None and not isinstance(value, str):
            raise ValueError(f"{where} must be a request id (a string), got {shown(value)}")

    def text(self, value: Any, where: str) -> None:
        if not isinstance(value, str):
            raise ValueError(f"{where} must be a string, got {shown(value)}")

    def figures(self, st: Any, where: str) -> None:
        for name, value in _dict(st, where).items():
            if not _is_number(value):
                raise ValueError(f"{where}.{name} must be a number, got {shown(value)}")

    def event(self, event: Any, where: str) -> None:
        kind = _dict(event, where).get("k")
        fields = EVENT_FIELDS.get(kind) if isinstance(kind, str) else None
        if fields is None:
            raise ValueError(
                f"{where}.k must be one of {', '.join(EVENT_FIELDS)}, got {shown(kind)}"
            )
        for name, rule in fields.items():
            if name not in event and rule != "req":
                raise ValueError(f"{where}.{name} is missing (a {kind} event needs it)")
            getattr(self, rule)(event.get(name), f"{where}.{name}")
        if "g" in event:
            self.count(event["g"], f"{where}.g")


def check_event(event: Any, num_blocks: int, where: str = "event") -> None:
    """ValueError naming the first field of one event the page could not draw safely."""
    _Checker(num_blocks).event(event, where)


def check_trace(trace: Mapping[str, Any]) -> None:
    """ValueError naming the first field the replay page could not draw safely."""
    start = _dict(trace["start"], "start")
    pool = _dict(start.get("pool"), "start.pool")
    num_blocks = pool.get("num_blocks")
    c = _Checker(0)
    c.id(num_blocks, "start.pool.num_blocks")
    c.num_blocks = num_blocks
    c.id(pool.get("block_size"), "start.pool.block_size")
    for name in _POOL_LISTS + tuple(n for n in _ADAPTER_LISTS if n in pool):
        values = _list(pool.get(name), f"start.pool.{name}")
        if len(values) != num_blocks:
            raise ValueError(f"start.pool.{name} must hold {num_blocks} values, got {len(values)}")
        for i, value in enumerate(values):
            c.count(value, f"start.pool.{name}[{i}]")
    for i, seq in enumerate(_list(pool.get("seqs"), "start.pool.seqs")):
        where = f"start.pool.seqs[{i}]"
        _dict(seq, where)
        c.id(seq.get("seq"), f"{where}.seq")
        c.req(seq.get("req"), f"{where}.req")
        c.entries(seq.get("blocks"), f"{where}.blocks")
        c.count(seq.get("tokens"), f"{where}.tokens")
        if "g" in seq:
            c.count(seq["g"], f"{where}.g")
    c.count(start.get("step"), "start.step")
    c.figures(start.get("st"), "start.st")
    for block, text in _dict(start.get("text", {}), "start.text").items():
        where = f"start.text[{block!r}]"
        c.block(int(block) if block.isascii() and block.isdigit() else block, f"{where} (key)")
        c.text(text, where)
    meta = _dict(trace.get("meta", {}), "meta")
    if meta.get("command") is not None:
        c.text(meta["command"], "meta.command")
    for i, record in enumerate(trace["records"]):
        where = f"records[{i}]"
        _dict(record, where)
        c.count(record.get("step"), f"{where}.step")
        c.figures(record.get("st"), f"{where}.st")
        for j, event in enumerate(_list(record.get("ev"), f"{where}.ev")):
            c.event(event, f"{where}.ev[{j}]")


def _is_number(value: Any) -> bool:
    # json.loads reads NaN and Infinity, which JSON in the page could not hold.
    return (is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _dict(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be an object, got {shown(value)}")
    return value


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise ValueError(f"{where} must be a list, got {shown(value)}")
    return value
