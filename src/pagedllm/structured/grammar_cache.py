"""Compiled grammars kept for reuse, bounded in bytes, the least recently used dropped first.

A compiled grammar's size ranges from kilobytes (an ordinary JSON schema) to hundreds of
megabytes (a choice among 50,000 strings), so a bound in entries bounds nothing: this one
counts each grammar's own figure of its memory. A grammar larger than the whole bound is
not kept (its request still uses it).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any


class GrammarCache:
    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.nbytes = 0  # what the kept grammars take
        self._entries: OrderedDict[bytes, tuple[Any, int]] = OrderedDict()

    def get(self, key: bytes) -> Any | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def put(self, key: bytes, grammar: Any, nbytes: int) -> None:
        if nbytes > self.max_bytes or key in self._entries:
            return
        self._entries[key] = (grammar, nbytes)
        self.nbytes += nbytes
        while self.nbytes > self.max_bytes:
            _, (_, dropped) = self._entries.popitem(last=False)
            self.nbytes -= dropped

    def __len__(self) -> int:
        return len(self._entries)
