"""PenaltyRows: which live sequences' penalty counts a runner keeps, and where.

Repetition, frequency and presence penalties read a sequence's prompt tokens and how often
each token is among its output tokens. Rather than receive them with every step, a runner
keeps them: a row of a count store per sequence with penalties, built once from the ids
its first row carries (new to the runner, readmitted after a preemption, or a sample just
forked from another), then counting the tokens each step keeps (a speculating row's
accepted proposals and its own token), and dropped when the sequence ends or is preempted.
The engine sends the ids exactly when the runner lacks the counts (engine/step_rows.py);
a row that leans on counts the runner does not hold, or on counts of another number of
output tokens than the row says, is refused. Row 0 of the store stays empty: rows without
penalties read it. Where the counts live is the store's business: sets and Counters for
the fake runner (ListCountStore), tensors for the real one (worker/token_counts.py).
Plain Python: no torch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Protocol

from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.worker.row_slots import RowSlots
from pagedllm.worker.runner import SampledTokens, SampleRow


class CountStore(Protocol):
    """Rows of token counts: per row, its prompt's tokens and its output tokens' counts."""

    def build(self, row: int, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        """Set `row` to these tokens alone (growing the store to fit)."""
        ...

    def add(self, rows: Sequence[int], token_ids: Sequence[int]) -> None:
        """Count token_ids[i] once more among the output tokens of rows[i]."""
        ...

    def clear(self, row: int) -> None:
        """Empty `row`."""
        ...


class ListCountStore:
    """Counts as Python sets and Counters: the store of a runner without tensors."""

    def __init__(self) -> None:
        self.prompts: list[set[int]] = [set()]
        self.outputs: list[Counter[int]] = [Counter()]

    def build(self, row: int, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        while len(self.prompts) <= row:
            self.prompts.append(set())
            self.outputs.append(Counter())
        self.prompts[row] = set(prompt_ids)
        self.outputs[row] = Counter(output_ids)

    def add(self, rows: Sequence[int], token_ids: Sequence[int]) -> None:
        for row, token in zip(rows, token_ids, strict=True):
            self.outputs[row][token] += 1

    def clear(self, row: int) -> None:
        self.prompts[row] = set()
        self.outputs[row] = Counter()


class PenaltyRows:
    def __init__(self, store: CountStore) -> None:
        self.store = store
        self.slots = RowSlots()  # slot s is the store's row s + 1
        self.num_outputs: dict[int, int] = {}  # sequence id -> output tokens its row counts

    def row_of(self, seq_id: int) -> int | None:
        """The store row of the sequence's counts, or None when the runner holds none."""
        slot = self.slots.row_of.get(seq_id)
        return None if slot is None else slot + 1

    def apply(self, step: SchedulerOutput, rows: Sequence[SampleRow]) -> list[int]:
        """Drop the counts of the sequences gone, build those the rows carry ids for, and
        return each row's store row (0, the empty one, for a row without penalties)."""
        for seq_id in (*step.finished_seq_ids, *step.preempted_seq_ids):
            self.drop(seq_id)
        store_rows = []
        for r in rows:
            if not r.params.has_penalties:
                store_rows.append(0)
                continue
            row = self.row_of(r.seq_id)
            if not r.runner_counts:
                row = row if row is not None else self.slots.take(r.seq_id) + 1
                self.store.build(row, r.prompt_ids, r.output_ids)
                self.num_outputs[r.seq_id] = len(r.output_ids)
            elif row is None:
                raise RuntimeError(
                    f"sequence {r.seq_id} came without its tokens, but the runner holds no "
                    "penalty counts of it"
                )
            elif self.num_outputs[r.seq_id] != r.num_output_tokens:
                raise RuntimeError(
                    f"sequence {r.seq_id} has {r.num_output_tokens} output tokens, but the "
                    f"runner's penalty counts hold {self.num_outputs[r.seq_id]}"
                )
            store_rows.append(row)
        return store_rows

    def add(self, rows: Sequence[SampleRow], sampled: SampledTokens) -> None:
        """Count the tokens each penalty row drew in `sampled`: its accepted proposals,
        then its own token (none for a row whose draw failed: its request ends)."""
        store_rows: list[int] = []
        token_ids: list[int] = []
        for i, r in enumerate(rows):
            if not r.params.has_penalties or i in sampled.row_errors:
                continue
            kept = sampled.accepted.get(i)
            drawn = [*(kept.token_ids if kept is not None else ()), sampled.token_ids[i]]
            store_rows += [self.slots.row_of[r.seq_id] + 1] * len(drawn)
            token_ids += drawn
            self.num_outputs[r.seq_id] += len(drawn)
        if token_ids:
            self.store.add(store_rows, token_ids)

    def drop(self, seq_id: int) -> None:
        """Free the sequence's counts (nothing when it has none)."""
        slot = self.slots.free(seq_id)
        if slot is not None:
            self.store.clear(slot + 1)
            del self.num_outputs[seq_id]
