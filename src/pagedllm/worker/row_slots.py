"""RowSlots: which row of a runner's preallocated store each live sequence holds.

A slot map (sequence id -> row) over rows that are handed out and given back: a freed row
is reused, the lowest first, so live rows stay packed at the top without moving any.
Plain Python: no torch.
"""

from __future__ import annotations

import heapq


class RowSlots:
    def __init__(self) -> None:
        self.row_of: dict[int, int] = {}  # sequence id -> its row
        self._free_rows: list[int] = []  # a heap: the lowest free row is taken first
        self.num_rows = 0  # rows ever handed out: the top of the packed rows

    def take(self, seq_id: int) -> int:
        """A row for `seq_id` (which must hold none): the lowest free one, else a new one
        at the top (`num_rows` grows)."""
        row = heapq.heappop(self._free_rows) if self._free_rows else self.num_rows
        self.num_rows = max(self.num_rows, row + 1)
        self.row_of[seq_id] = row
        return row

    def free(self, seq_id: int) -> int | None:
        """Give back the sequence's row; which it was, or None when it held none."""
        row = self.row_of.pop(seq_id, None)
        if row is not None:
            heapq.heappush(self._free_rows, row)
        return row
