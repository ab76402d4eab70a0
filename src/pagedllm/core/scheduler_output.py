"""What the scheduler hands the runner each step, and the table deltas in it.

A SchedulerOutput lists each scheduled sequence's chunk (ScheduledSeq) and what changed
in the pool since the last step that ran. The runner keeps its own copy of the running
sequences' block tables (vLLM v1's persistent batch); SentTables remembers what that copy
holds, so a running sequence sends only the block ids its tables gained, and its whole
tables when it is new to the runner or an entry changed in place.
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
    """Per sequence, each group's (rewrites, entries) when it was last scheduled."""

    def __init__(self) -> None:
        self._sent: dict[int, list[tuple[int, int]]] = {}

    def changes(
        self, seq_id: int, groups: Sequence[BlockTable]
    ) -> tuple[tuple[tuple[int, ...], ...], bool]:
        """What the runner's copy of the sequence's tables (`groups`, now) lacks: per group
        the entries appended since it last ran, or the whole tables (True) when it has none
        or an entry changed in place since (a truncation counts as such a change)."""
        now = [(t.num_rewrites, len(t.blocks)) for t in groups]
        sent = self._sent.get(seq_id)
        if now == sent:  # most decode steps: nothing new
            return ((),) * len(groups), False
        self._sent[seq_id] = now
        if sent is None or any(n[0] != was[0] for n, was in zip(now, sent, strict=True)):
            return tuple(tuple(t.blocks) for t in groups), True
        return tuple(tuple(t.blocks[was[1] :]) for t, was in zip(groups, sent, strict=True)), False

    def forget(self, seq_id: int) -> None:
        """The sequence left the runner (ended or preempted)."""
        self._sent.pop(seq_id, None)
