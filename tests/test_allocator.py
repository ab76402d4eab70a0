"""BlockAllocator and BlockTable: exact block ids, exact free-queue order, reference
counts, copy-on-write, and the prefix cache's LRU eviction."""

from __future__ import annotations

import pytest

from inspect_internals import free_block_ids
from pagedllm.errors import NoFreeBlocksError
from pagedllm.kv.allocator import BlockAllocator
from pagedllm.kv.block_hash import hash_block
from pagedllm.kv.block_table import BlockTable


def test_allocate_and_free_exact_order() -> None:
    a = BlockAllocator(6)
    assert free_block_ids(a) == [0, 1, 2, 3, 4, 5]
    assert [a.allocate() for _ in range(3)] == [0, 1, 2]
    assert free_block_ids(a) == [3, 4, 5]
    a.free(1)
    a.free(0)
    # Uncached blocks return to the front: the most recently freed is reused first.
    assert free_block_ids(a) == [0, 1, 3, 4, 5]
    assert a.allocate_many(2) == [0, 1]
    assert a.num_free_blocks == 3 and a.num_used_blocks == 3


def test_allocate_many_is_all_or_nothing() -> None:
    a = BlockAllocator(3)
    a.allocate()
    with pytest.raises(NoFreeBlocksError):
        a.allocate_many(3)
    assert free_block_ids(a) == [1, 2]


def test_reference_counts_and_errors() -> None:
    a = BlockAllocator(4)
    b = a.allocate()
    a.incref(b)
    assert a.ref_count(b) == 2
    a.free(b)
    assert a.ref_count(b) == 1 and b not in free_block_ids(a)
    a.free(b)
    assert a.ref_count(b) == 0 and free_block_ids(a)[0] == b
    with pytest.raises(ValueError, match="double free"):
        a.free(b)
    with pytest.raises(ValueError, match="unknown KV block 9"):
        a.free(9)
    with pytest.raises(ValueError, match="free and not cached"):
        a.incref(3)


def test_block_table_grows_only_when_full() -> None:
    a = BlockAllocator(8)
    t = BlockTable(4, a)
    assert t.append_slots(3) == [] and t.blocks == [0]
    assert t.append_slots(4) == [] and t.blocks == [0]
    assert t.append_slots(5) == [] and t.blocks == [0, 1]
    assert [t.slot(i) for i in range(5)] == [0, 1, 2, 3, 4]
    assert t.append_slots(13) == [] and t.blocks == [0, 1, 2, 3]
    assert t.slot(12) == 12
    with pytest.raises(IndexError):
        t.slot(16)
    # A request larger than the pool changes nothing.
    assert t.append_slots(4 * 9) is None and t.blocks == [0, 1, 2, 3] and t.num_tokens == 13
    t.free()
    assert free_block_ids(a) == [0, 1, 2, 3, 4, 5, 6, 7]


def test_fork_then_copy_on_write_of_the_shared_partial_block() -> None:
    a = BlockAllocator(8)
    parent = BlockTable(4, a)
    parent.append_slots(6)  # blocks [0, 1]; block 1 holds 2 of 4 tokens
    child = parent.fork()
    assert child.blocks == [0, 1] and a.ref_count(0) == 2 and a.ref_count(1) == 2
    # The child's next token lands in shared block 1: exactly one copy, into block 2.
    assert child.append_slots(7) == [(1, 2)]
    assert child.blocks == [0, 2] and parent.blocks == [0, 1]
    assert a.ref_count(1) == 1 and a.ref_count(2) == 1 and a.ref_count(0) == 2
    # The parent now owns block 1 alone: no copy.
    assert parent.append_slots(7) == []
    # Growing into a fresh block never copies; full shared blocks are never copied.
    assert child.append_slots(9) == [] and child.blocks == [0, 2, 3]
    assert a.ref_count(0) == 2


def test_fork_at_a_block_boundary_needs_no_copy() -> None:
    a = BlockAllocator(8)
    parent = BlockTable(4, a)
    parent.append_slots(8)
    child = parent.fork()
    assert child.append_slots(9) == [] and child.blocks == [0, 1, 2]
    assert parent.append_slots(9) == [] and parent.blocks == [0, 1, 3]


def lookup(a: BlockAllocator, parent_hash: bytes, token_ids: list[int]) -> tuple[int, bytes] | None:
    """The cached block holding exactly these tokens after this parent, and its hash."""
    block_hash = hash_block(parent_hash, token_ids)
    block = a.cached_block(0, block_hash, parent_hash, token_ids)
    return None if block is None else (block, block_hash)


def test_prefix_cache_lookup_confirms_tokens_and_evicts_lru() -> None:
    a = BlockAllocator(4)
    blocks = a.allocate_many(3)  # [0, 1, 2]
    h0 = a.register(0, b"", [1, 2])
    h1 = a.register(1, h0, [3, 4])
    a.register(2, b"", [9, 9])
    assert lookup(a, b"", [1, 2]) == (0, h0)
    assert lookup(a, h0, [3, 4]) == (1, h1)
    assert lookup(a, h0, [3, 5]) is None  # different tokens
    assert lookup(a, b"", [3, 4]) is None  # same tokens, different parent
    for b in blocks:
        a.free(b)
    # Cached blocks wait behind uncached block 3, least recently freed first.
    assert free_block_ids(a) == [3, 0, 1, 2]
    # A hit takes block 1 back out of the middle of the queue.
    a.incref(1)
    assert free_block_ids(a) == [3, 0, 2]
    a.free(1)
    assert free_block_ids(a) == [3, 0, 2, 1]
    assert a.allocate() == 3  # the worthless block goes first
    assert a.allocate() == 0  # then the LRU cached block, whose hash is forgotten
    assert lookup(a, b"", [1, 2]) is None
    assert a.num_evictions == 1 and a.num_cached_blocks == 2


def test_hash_collision_cannot_hand_out_other_tokens() -> None:
    a = BlockAllocator(2)
    block_hash = a.register(a.allocate(), b"", [1, 2])
    assert a.cached_block(0, block_hash, b"", [1, 2]) == 0
    # Other tokens under the same hash (a collision): a miss, never block 0's K/V.
    assert a.cached_block(0, block_hash, b"", [7, 7]) is None
