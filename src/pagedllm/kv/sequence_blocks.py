"""SequenceBlocks: one sequence's block tables, one per layer group; CachedPrefix: a hit.

Every group's table covers the same tokens (the sequence's), but each names its own
physical blocks: a sliding-window group's table has the null block where its window has
passed. A model of one kind has one group, and so one table per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.kv.block_table import BlockTable


@dataclass(frozen=True)
class CachedPrefix:
    """A new sequence's prefix-cache hit: its first `num_blocks` blocks, as each group's
    table entries (the null block behind a window), and their chained hashes."""

    tables: tuple[tuple[int, ...], ...]
    hashes: tuple[bytes, ...]

    def __post_init__(self) -> None:
        if any(len(t) != len(self.hashes) for t in self.tables):
            raise ValueError("every group's hit must cover the same blocks as the hashes")

    @property
    def num_blocks(self) -> int:
        return len(self.hashes)

    @classmethod
    def empty(cls, num_groups: int) -> CachedPrefix:
        return cls(((),) * num_groups, ())


class SequenceBlocks:
    """The tables of one sequence, `groups[g]` for layer group g."""

    def __init__(self, groups: list[BlockTable], lora_id: int = 0) -> None:
        if not groups:
            raise ValueError("a sequence needs one block table per layer group, at least one")
        self.groups = groups
        self.lora_id = lora_id  # the adapter it runs under: its prefix-cache chain's root

    @property
    def num_tokens(self) -> int:
        """Tokens whose slots are claimed (the same in every group)."""
        return self.groups[0].num_tokens

    @property
    def capacity(self) -> int:
        """Token positions the tables span (null entries included)."""
        return max(t.capacity for t in self.groups)

    @property
    def blocks(self) -> list[int]:
        """Every pool block the sequence's tables point at, group by group, null entries
        left out: with one full-attention group, exactly its block table."""
        return [b for t in self.groups for b in t.real_blocks()]

    def group_blocks(self) -> tuple[int, ...]:
        """Pool blocks each group's table holds (null entries left out)."""
        return tuple(len(t.real_blocks()) for t in self.groups)
