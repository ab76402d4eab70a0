"""What the scheduler hands the runner each step, and the table deltas in it.

A SchedulerOutput lists each scheduled sequence's chunk (ScheduledSeq) and what changed
in the pool since the last step that ran. The runner keeps its own copy of the running
sequences' block tables (vLLM v1's persistent batch); SentTables remembers what that copy
holds, so a running sequence sends only what changed: the entries its tables lost (a
truncation: TableEdit's `keep`), the entries now the null block (behind a window:
`null_start:null_stop`), and the block ids they gained; its whole tables only when it is
new to the runner or an entry was replaced in place (copy-on-write).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedllm.kv.block_table import BlockTable


@dataclass(frozen=True)
class AdapterLoad:
    """An adapter the runner must write into pool pages before this step's forward: it
    was not resident (first use, or evicted since), and now owns `pages`."""

    lora_id: int
    lora_path: str
    pages: tuple[int, ...]


@dataclass(frozen=True)
class TableEdit:
    """What one layer group's table lost since the runner last saw it, applied before the
    appended ids: keep its first `keep` entries (rejected lookahead given back), and
    entries `null_start:null_stop` (those of them kept) are now `null_block` (given back
    behind a window)."""

    keep: int
    null_start: int = 0
    null_stop: int = 0
    null_block: int = 0


@dataclass(frozen=True)
class ScheduledSeq:
    """One sequence's share of a step: compute `token_ids` at positions from `start_pos`."""

    request_id: str
    seq_id: int
    token_ids: tuple[int, ...]
    start_pos: int
    # Per layer group (kv/groups.py; a model of one kind has one): the block ids the
    # sequence's table gained since the runner last saw it, or, with `replaces_tables`,
    # its whole table.
    new_block_ids: tuple[tuple[int, ...], ...]
    needs_logits: bool  # the chunk reaches the sequence's last token
    # Proposed tokens, the chunk's last len(draft_token_ids) tokens: each of the k+1
    # positions from the sequence's last token on needs its logits row.
    draft_token_ids: tuple[int, ...] = ()
    # New to the runner, or an entry changed in place: `new_block_ids` are whole tables.
    replaces_tables: bool = True
    lora_id: int = 0  # the adapter its rows run under (0: the base model)
    # Per layer group, an edit applied before `new_block_ids` are appended (None: none),
    # or () when no group has one; never with `replaces_tables`.
    table_edits: tuple[TableEdit | None, ...] = ()

    @property
    def num_logits_rows(self) -> int:
        """Logits rows this sequence takes in the step's logits (0, 1, or k+1)."""
        return 1 + len(self.draft_token_ids) if self.needs_logits else 0


@dataclass(frozen=True)
class SchedulerOutput:
    seqs: tuple[ScheduledSeq, ...]
    # request id -> tokens each of the request's sequences computes this step (its live
    # sequences always have the same length, so one chunk size serves them all)
    chunk_sizes: dict[str, int]
    blocks_to_copy: tuple[tuple[int, int], ...]  # copy-on-write (source, destination)
    preempted: tuple[str, ...]
    finished_seq_ids: tuple[int, ...] = ()  # sequences gone since the last step that ran
    # Sequences preempted since the last step that ran: their rows go, their state (a
    # seeded generator) stays; they come back with whole tables.
    preempted_seq_ids: tuple[int, ...] = ()
    # Adapters to write into their pages before the forward (LoRA), and the pages of every
    # adapter a scheduled sequence runs under.
    lora_loads: tuple[AdapterLoad, ...] = ()
    lora_pages: dict[int, tuple[int, ...]] = field(default_factory=dict)

    @property
    def request_ids(self) -> tuple[str, ...]:
        """The requests this step computes, in schedule order."""
        return tuple(self.chunk_sizes)

    @property
    def num_batched_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


class SentTables:
    """Per sequence, each group's table as the runner last saw it: (rewrites, truncations,
    null entries, entries)."""

    def __init__(self) -> None:
        self._sent: dict[int, list[tuple[int, int, int, int]]] = {}

    def changes(
        self, seq_id: int, groups: Sequence[BlockTable]
    ) -> tuple[tuple[tuple[int, ...], ...], bool, tuple[TableEdit | None, ...]]:
        """What the runner's copy of the sequence's tables (`groups`, now) lacks: per group
        the edit (entries lost, entries nulled) and the entries appended since it last ran;
        or the whole tables (True, no edits) when it has none or an entry was replaced in
        place since. A table truncated twice since (its shortest length in between
        unknown) is sent whole too."""
        now = [(t.num_rewrites, t.num_truncations, t.num_dropped, len(t.blocks)) for t in groups]
        sent = self._sent.get(seq_id)
        if now == sent:  # most decode steps: nothing new
            return ((),) * len(groups), False, ()
        self._sent[seq_id] = now
        if sent is None or any(map(_needs_whole, groups, sent)):
            return tuple(tuple(t.blocks) for t in groups), True, ()
        appended = []
        edits: list[TableEdit | None] = []
        for t, was in zip(groups, sent, strict=True):
            _, truncations, dropped, length = was
            keep = length if t.num_truncations == truncations else min(length, t.truncated_to)
            if keep < length or t.num_dropped > dropped:
                # Entries past `keep` come with the appended ids, null or not.
                null_stop = max(dropped, min(t.num_dropped, keep))
                null = t.null_block if t.null_block is not None else 0
                edits.append(TableEdit(keep, dropped, null_stop, null))
            else:
                edits.append(None)
            appended.append(tuple(t.blocks[keep:]))
        return tuple(appended), False, tuple(edits) if any(edits) else ()

    def forget(self, seq_id: int) -> None:
        """The sequence left the runner (ended or preempted)."""
        self._sent.pop(seq_id, None)


def _needs_whole(table: BlockTable, sent: tuple[int, int, int, int]) -> bool:
    """Whether the table changed since `sent` in a way an edit does not say: an entry
    replaced, two truncations (the shortest length in between is lost), or fewer null
    entries or entries than the runner holds with no truncation to explain it."""
    rewrites, truncations, dropped, length = sent
    if table.num_rewrites != rewrites or table.num_dropped < dropped:
        return True
    if table.num_truncations == truncations:
        return len(table.blocks) < length
    return table.num_truncations > truncations + 1
