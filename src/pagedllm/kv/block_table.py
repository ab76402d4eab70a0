"""BlockTable: one sequence's map from logical blocks to physical blocks.

Token i lives in logical block i // block_size, slot i % block_size. The table grows by
one block when its last block is full, never before; a write into a last block that
other tables share copies it first (copy-on-write). A table of a sliding-window layer
group gives back the blocks wholly behind its window: their entries become the null
block, an id outside the pool that holds nothing and that no kernel reads.
"""

from __future__ import annotations

from pagedllm.errors import NoFreeBlocksError
from pagedllm.kv.allocator import BlockAllocator
from pagedllm.validation import check_int

MAX_BLOCK_SIZE = 256


def check_block_size(block_size: int) -> None:
    """The one rule for block sizes, shared by the engine, its CLI and the benches."""
    check_int(block_size, "block_size", min=1, max=MAX_BLOCK_SIZE)


class BlockTable:
    def __init__(
        self, block_size: int, allocator: BlockAllocator, null_block: int | None = None
    ) -> None:
        """`null_block`: the id that stands for a block given back behind a window (None:
        this table never gives any back)."""
        self.block_size = block_size
        self.allocator = allocator
        self.null_block = null_block
        self.blocks: list[int] = []
        # Leading entries that are the null block (all before the window).
        self.num_dropped = 0
        # Tokens whose slots are claimed (written, or to be written by the current step).
        self.num_tokens = 0
        # Chained hashes of the leading full blocks already offered to the prefix cache.
        self.block_hashes: list[bytes] = []
        # Entries replaced in place (copy-on-write): the scheduler sends the runner the
        # whole table after one. After a truncation it sends the new length (the entries
        # after the latest one: `truncated_to`), after blocks given back behind the window
        # the null entries (`num_dropped`), and the appended entries (core/scheduler_output.py).
        self.num_rewrites = 0
        self.num_truncations = 0
        self.truncated_to = 0

    def __len__(self) -> int:
        return len(self.blocks)

    @property
    def capacity(self) -> int:
        return len(self.blocks) * self.block_size

    def slot(self, token_index: int) -> int:
        """The physical slot (block id * block_size + offset) of token `token_index`."""
        if not 0 <= token_index < self.capacity:
            raise IndexError(f"token {token_index} is outside the table's {self.capacity} slots")
        block = self.blocks[token_index // self.block_size]
        return block * self.block_size + token_index % self.block_size

    def blocks_needed(self, num_tokens: int) -> int:
        """New blocks (copy-on-write included) to hold `num_tokens` tokens in all."""
        needed = max(0, -(-num_tokens // self.block_size) - len(self.blocks))
        if self._next_write_is_shared(num_tokens):
            needed += 1
        return needed

    def append_slots(self, num_tokens: int) -> list[tuple[int, int]] | None:
        """Claim slots so the table holds `num_tokens` tokens in all.

        Returns the (source, destination) block copies that copy-on-write needs, or None
        (and changes nothing) when the pool cannot serve the whole request.
        """
        needed = self.blocks_needed(num_tokens)
        if needed > self.allocator.num_free_blocks:
            return None
        copies: list[tuple[int, int]] = []
        if self._next_write_is_shared(num_tokens):
            index = self.num_tokens // self.block_size
            src = self.blocks[index]
            dst = self.allocator.allocate()
            self.allocator.free(src)
            self.blocks[index] = dst
            self.num_rewrites += 1
            copies.append((src, dst))
        while self.capacity < num_tokens:
            self.blocks.append(self.allocator.allocate())
        bs = self.block_size
        for i in range(self.num_tokens // bs, -(-num_tokens // bs)):  # the blocks written
            self.allocator.note_filled(self.blocks[i], min(bs, num_tokens - i * bs))
        self.num_tokens = max(self.num_tokens, num_tokens)
        return copies

    def truncate(self, num_tokens: int) -> list[int]:
        """Give back the slots past the first `num_tokens` tokens (lookahead slots of
        rejected proposals): blocks wholly past them return to the pool. Returns the
        blocks given back. Never below the hashed (prefix-cached) blocks."""
        if num_tokens >= self.num_tokens:
            return []
        if num_tokens < len(self.block_hashes) * self.block_size:
            raise RuntimeError("cannot truncate a block table into its prefix-cached blocks")
        bs = self.block_size
        keep = max(-(-num_tokens // bs), self.num_dropped)
        given = []
        if len(self.blocks) > keep:
            self.num_truncations += 1
            self.truncated_to = keep
        while len(self.blocks) > keep:
            block = self.blocks.pop()
            if block != self.null_block:
                self.allocator.free(block)
                given.append(block)
        if num_tokens % bs and len(self.blocks) > num_tokens // bs:
            last = self.blocks[num_tokens // bs]
            if last != self.null_block:
                self.allocator.note_emptied(last, num_tokens % bs)
        self.num_tokens = num_tokens
        return given

    def reserve(self, num_tokens: int) -> bool:
        """Allocate blocks for `num_tokens` tokens up front (the contiguous-reservation
        baselines) without claiming their slots; all or nothing."""
        needed = max(0, -(-num_tokens // self.block_size) - len(self.blocks))
        try:
            self.blocks.extend(self.allocator.allocate_many(needed))
        except NoFreeBlocksError:
            return False
        return True

    def add_cached_blocks(self, blocks: list[int], block_hashes: list[bytes]) -> None:
        """Start the table with prefix-cache hits (the caller took their references);
        entries behind a window are the null block."""
        if self.blocks:
            raise RuntimeError("prefix-cache hits can only start an empty block table")
        self.blocks = list(blocks)
        self.block_hashes = list(block_hashes)
        self.num_tokens = len(blocks) * self.block_size
        self.num_dropped = 0
        while self.num_dropped < len(blocks) and blocks[self.num_dropped] == self.null_block:
            self.num_dropped += 1

    def drop_blocks_before(self, first_needed_token: int) -> list[tuple[int, int]]:
        """Give back the blocks wholly before token `first_needed_token` (behind the
        window of the next token computed); their entries become the null block.
        Returns the (index, block) pairs given back."""
        if self.null_block is None:
            raise RuntimeError("this table keeps every block: it has no null block")
        end = min(max(0, first_needed_token) // self.block_size, len(self.blocks))
        dropped = []
        for i in range(self.num_dropped, end):
            block = self.blocks[i]
            if block != self.null_block:
                self.allocator.free(block)
                self.blocks[i] = self.null_block
                dropped.append((i, block))
        self.num_dropped = max(self.num_dropped, end)
        return dropped

    def real_blocks(self) -> list[int]:
        """The table's blocks from the pool (null entries left out), in logical order."""
        return self.blocks[self.num_dropped :]

    def fork(self) -> BlockTable:
        """A new table pointing at the same physical blocks (reference counts go up)."""
        child = BlockTable(self.block_size, self.allocator, self.null_block)
        for block in self.real_blocks():
            self.allocator.incref(block)
        child.blocks = list(self.blocks)
        child.num_dropped = self.num_dropped
        child.num_tokens = self.num_tokens
        child.block_hashes = list(self.block_hashes)
        return child

    def free(self) -> None:
        """Release every block; the tail first, so a prefix's head stays cached longest."""
        for block in reversed(self.real_blocks()):
            self.allocator.free(block)
        self.blocks = []
        self.num_dropped = 0
        self.block_hashes = []
        self.num_tokens = 0

    def _next_write_is_shared(self, num_tokens: int) -> bool:
        """Whether the next token to be written lands in an existing block others share.

        That block is never full: it is the partly filled last block after a fork, or an
        empty block reserved up front."""
        if num_tokens <= self.num_tokens:
            return False
        index = self.num_tokens // self.block_size
        return index < len(self.blocks) and self.allocator.ref_count(self.blocks[index]) > 1
