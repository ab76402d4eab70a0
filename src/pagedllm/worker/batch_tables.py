"""BatchTables: a runner's own copy of the running sequences' block tables.

The scheduler sends each step's changes only (core/scheduler.py): a sequence new to the
runner with its whole tables, a running one with what its tables lost (a shorter length,
entries now the null block: TableEdit) and the ids they gained. This mirror
gives each live sequence a row of a preallocated table per layer group, found through a
slot map (worker/row_slots.py), and applies the changes in place. Where the rows
live is the store's business: plain lists for the fake runner, tensors for the real one
(worker/input_batch.py). Plain Python: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.worker.row_slots import RowSlots


class TableStore(Protocol):
    """Where the rows' block ids live: one table [rows, entries] per layer group."""

    def write(self, group: int, row: int, start: int, block_ids: Sequence[int]) -> None:
        """Set entries `start:start+len(block_ids)` of `row` (growing the table to fit)."""
        ...

    def clear(self, group: int, row: int, length: int) -> None:
        """Zero the first `length` entries of `row` (a row padded with zeros past its
        table, as the attention metadata has always been)."""
        ...

    def read(self, group: int, row: int, length: int) -> list[int]:
        """The first `length` entries of `row`."""
        ...


class ListTableStore:
    """Rows as Python lists: the store of a runner without tensors."""

    def __init__(self, num_groups: int) -> None:
        self.rows: list[list[list[int]]] = [[] for _ in range(num_groups)]

    def write(self, group: int, row: int, start: int, block_ids: Sequence[int]) -> None:
        rows = self.rows[group]
        while len(rows) <= row:
            rows.append([])
        entries = rows[row]
        entries.extend([0] * (start + len(block_ids) - len(entries)))
        entries[start : start + len(block_ids)] = block_ids

    def clear(self, group: int, row: int, length: int) -> None:
        if row < len(self.rows[group]):
            entries = self.rows[group][row]
            entries[:length] = [0] * min(length, len(entries))

    def read(self, group: int, row: int, length: int) -> list[int]:
        return self.rows[group][row][:length] if length else []


class BatchTables:
    def __init__(self, num_groups: int, store: TableStore) -> None:
        self.num_groups = num_groups
        self.store = store
        self.slots = RowSlots()
        # lengths[g][row]: the entries of row `row`'s table in group g
        self.lengths: list[list[int]] = [[] for _ in range(num_groups)]

    @property
    def row_of(self) -> dict[int, int]:
        """Sequence id -> its row."""
        return self.slots.row_of

    def apply(self, step: SchedulerOutput) -> list[int]:
        """Drop the rows of the sequences gone, apply the step's table changes, and
        return the row of each scheduled sequence, in order."""
        for seq_id in (*step.finished_seq_ids, *step.preempted_seq_ids):
            self.drop(seq_id)
        rows = []
        for s in step.seqs:
            if len(s.new_block_ids) != self.num_groups:
                raise ValueError(
                    f"sequence {s.seq_id} has tables of {len(s.new_block_ids)} layer groups, "
                    f"the runner {self.num_groups}"
                )
            row = self.row_of.get(s.seq_id)
            if row is None:
                if not s.replaces_tables:
                    raise RuntimeError(
                        f"sequence {s.seq_id} came with table changes, but the runner has "
                        "no tables of it"
                    )
                row = self._new_row(s.seq_id)
            for g, block_ids in enumerate(s.new_block_ids):
                edit = s.table_edits[g] if s.table_edits else None
                if not block_ids and edit is None and not s.replaces_tables:
                    continue  # most decode steps: the table is as the runner has it
                lengths = self.lengths[g]
                if s.replaces_tables:
                    self.store.clear(g, row, lengths[row])
                    lengths[row] = 0
                elif edit is not None:
                    self._edit(g, row, edit.keep, edit.null_start, edit.null_stop, edit.null_block)
                self.store.write(g, row, lengths[row], block_ids)
                lengths[row] += len(block_ids)
            rows.append(row)
        return rows

    def _edit(
        self, group: int, row: int, keep: int, null_start: int, null_stop: int, null_block: int
    ) -> None:
        """A TableEdit: shorten the row to `keep` entries (zeros past them, as past every
        table) and null its entries `null_start:null_stop`; only what changed is written."""
        length = self.lengths[group][row]
        if not 0 <= keep <= length or not 0 <= null_start <= null_stop:
            raise RuntimeError(
                f"a table edit (keep {keep}, null {null_start}:{null_stop}) does not fit a "
                f"table of {length} entries"
            )
        if keep < length:
            self.store.write(group, row, keep, [0] * (length - keep))
            self.lengths[group][row] = keep
        stop = min(null_stop, keep)
        if null_start < stop:
            self.store.write(group, row, null_start, [null_block] * (stop - null_start))

    def drop(self, seq_id: int) -> None:
        """Free the sequence's row (nothing when it has none)."""
        row = self.slots.free(seq_id)
        if row is None:
            return
        for g in range(self.num_groups):
            self.store.clear(g, row, self.lengths[g][row])
            self.lengths[g][row] = 0

    def table_len(self, seq_id: int, group: int = 0) -> int:
        """The entries of the sequence's table in `group`."""
        return self.lengths[group][self.row_of[seq_id]]

    def width(self, rows: Sequence[int], group: int) -> int:
        """The longest table among `rows` in `group` (at least 1: a tensor's width)."""
        lengths = self.lengths[group]
        return max(1, max((lengths[r] for r in rows), default=1))

    def _new_row(self, seq_id: int) -> int:
        row = self.slots.take(seq_id)
        for lengths in self.lengths:
            lengths.extend([0] * (self.slots.num_rows - len(lengths)))
        return row
