"""InputBatch: the real runner's persistent batch of block tables, as host tensors.

One preallocated table [rows, entries] per layer group (long, grown by doubling when a
row or a table outgrows it), kept by worker/batch_tables.py's BatchTables from the step's
changes. A step's tables are one gather of its rows: no tensor is built per sequence.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.worker.batch_tables import BatchTables


class TensorTableStore:
    """Block tables as host tensors, one [rows, entries] per layer group."""

    def __init__(self, num_groups: int, rows: int, entries: int) -> None:
        self.tables = [torch.zeros((rows, entries), dtype=torch.long) for _ in range(num_groups)]

    def write(self, group: int, row: int, start: int, block_ids: Sequence[int]) -> None:
        self._fit(group, row + 1, start + len(block_ids))  # a row in the table, even empty
        if block_ids:
            self.tables[group][row, start : start + len(block_ids)] = torch.as_tensor(
                block_ids, dtype=torch.long
            )

    def clear(self, group: int, row: int, length: int) -> None:
        if length:
            self.tables[group][row, :length] = 0

    def read(self, group: int, row: int, length: int) -> list[int]:
        return self.tables[group][row, :length].tolist()

    def _fit(self, group: int, rows: int, entries: int) -> None:
        table = self.tables[group]
        have_rows, have_entries = table.shape
        if rows <= have_rows and entries <= have_entries:
            return
        new_rows = have_rows if rows <= have_rows else max(rows, 2 * have_rows)
        new_entries = have_entries if entries <= have_entries else max(entries, 2 * have_entries)
        grown = torch.zeros((new_rows, new_entries), dtype=torch.long)
        grown[:have_rows, :have_entries] = table
        self.tables[group] = grown


class InputBatch:
    def __init__(self, num_groups: int, rows: int = 8, entries: int = 16) -> None:
        """`rows`, `entries`: the tables' first size (they grow as needed)."""
        self.store = TensorTableStore(num_groups, rows, entries)
        self.mirror = BatchTables(num_groups, self.store)

    def step_tables(self, step: SchedulerOutput) -> list[torch.Tensor]:
        """Apply the step's table changes; then per layer group the scheduled sequences'
        tables [sequences, longest table] (padded with 0), in step order."""
        rows = self.mirror.apply(step)
        index = torch.tensor(rows, dtype=torch.long)
        return [
            table[index, : self.mirror.width(rows, g)] for g, table in enumerate(self.store.tables)
        ]
