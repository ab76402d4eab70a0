"""Attention kinds: which keys a layer's queries read, in the terms block bookkeeping needs.

Each kind owns its rules: the first token a query at position p reads, how many blocks a
sequence holds at most while it is computed, and whether it keeps every block or gives
back those behind every later query. From the first-token rule follow the rest: which
leading blocks go back to the pool, and which blocks a prefix-cache hit needs cached.
The manager (kv/manager.py) and the layer groups (kv/groups.py) ask a group's kind and
never branch on it; another kind (chunked local attention, say) is one more class here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from pagedllm.validation import check_int


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class AttentionKind(ABC):
    """The rules of one kind of attention layer."""

    # Tokens a query reads back, itself included (None: all of them).
    window: int | None
    # Whether a sequence gives back leading blocks that no later query reads (their table
    # entries then become the null block).
    drops_blocks: ClassVar[bool]

    @abstractmethod
    def first_needed_token(self, position: int) -> int:
        """The first key a query at `position` reads."""

    @abstractmethod
    def blocks_held(self, num_tokens: int, block_size: int, chunk: int) -> int:
        """Blocks a sequence of `num_tokens` tokens holds at most, computed `chunk`
        tokens a step."""

    def first_needed_block(self, num_tokens: int, block_size: int) -> int:
        """The first block read to compute the token after the first `num_tokens`."""
        return self.first_needed_token(num_tokens) // block_size

    def is_hit(self, cached: Sequence[int | None], n: int, block_size: int) -> bool:
        """Whether the first `n` blocks serve as a prefix-cache hit when `cached` names
        each leading block's cached copy (None: not cached): the blocks the token after
        them reads must all be cached."""
        first = self.first_needed_block(n * block_size, block_size)
        return all(block is not None for block in cached[first:n])


@dataclass(frozen=True)
class FullAttention(AttentionKind):
    """Every query reads every earlier key: a sequence keeps all its blocks."""

    window: ClassVar[None] = None
    drops_blocks: ClassVar[bool] = False

    def first_needed_token(self, position: int) -> int:
        return 0

    def blocks_held(self, num_tokens: int, block_size: int, chunk: int) -> int:
        return _ceil_div(num_tokens, block_size)


@dataclass(frozen=True)
class SlidingWindow(AttentionKind):
    """A query at p reads the keys from p - W + 1 to p."""

    window: int
    drops_blocks: ClassVar[bool] = True

    def __post_init__(self) -> None:
        check_int(self.window, "window", min=1, subject="a sliding window")

    def first_needed_token(self, position: int) -> int:
        return max(0, position - self.window + 1)

    def blocks_held(self, num_tokens: int, block_size: int, chunk: int) -> int:
        # Keys from s - W + 1 to s + chunk - 1 for a chunk at s: W - 1 + chunk tokens,
        # which may start anywhere in a block.
        every = _ceil_div(num_tokens, block_size)
        return min(every, _ceil_div(self.window - 1 + chunk, block_size) + 1)


def attention_kind(window: int | None) -> AttentionKind:
    """The kind of a layer whose window is `window` tokens (None: full attention)."""
    return FullAttention() if window is None else SlidingWindow(window)
