"""Attention kinds own their rules (first needed token, blocks held, cache-hit rule), and
a new kind is one class: chunked local attention, defined here alone, runs through the
manager's growth and prefix cache with exact block ids. The block hash is one rule: the
router's hashes of a prompt are the manager's hashes of its cached prefix."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest

from pagedllm.kv import KVCacheManager
from pagedllm.kv.attention_kinds import AttentionKind, FullAttention, SlidingWindow
from pagedllm.kv.block_hash import hash_block, prompt_block_hashes
from pagedllm.kv.groups import KVGroupSpec


@dataclass(frozen=True)
class ChunkedLocalAttention(AttentionKind):
    """A query at p reads the keys of its own chunk of `window` tokens, from the chunk's
    first token (p // C) * C to p."""

    window: int
    drops_blocks: ClassVar[bool] = True

    def first_needed_token(self, position: int) -> int:
        return position // self.window * self.window

    def blocks_held(self, num_tokens: int, block_size: int, chunk: int) -> int:
        every = -(-num_tokens // block_size)
        return min(every, -(-(self.window - 1 + chunk) // block_size) + 1)


def test_full_attention_reads_and_keeps_everything() -> None:
    full = FullAttention()
    assert [full.first_needed_token(p) for p in (0, 7, 100)] == [0, 0, 0]
    assert full.blocks_held(num_tokens=17, block_size=4, chunk=1) == 5
    assert full.is_hit([3, 5, 9], 3, 4)
    assert not full.is_hit([3, None, 9], 3, 4)  # every leading block is read
    assert full.window is None and not full.drops_blocks


def test_sliding_window_reads_its_window() -> None:
    window = SlidingWindow(8)
    assert [window.first_needed_token(p) for p in (0, 7, 8, 11, 20)] == [0, 0, 1, 4, 13]
    assert window.first_needed_block(20, 4) == 3  # token 20 reads keys 13..20
    # Decoding holds the window's 7 earlier keys and the new one: at most 3 blocks of 4
    # (4 when they straddle); a chunk of 6 at once, 14 keys: at most 5.
    assert window.blocks_held(num_tokens=100, block_size=4, chunk=1) == 3
    assert window.blocks_held(num_tokens=100, block_size=4, chunk=6) == 5
    assert window.blocks_held(num_tokens=6, block_size=4, chunk=6) == 2
    assert window.is_hit([None, None, None, 7, 9], 5, 4)  # the token after reads 3 and 4
    assert not window.is_hit([None, None, None, None, 9], 5, 4)
    assert window.window == 8 and window.drops_blocks


def test_a_new_kind_is_one_class() -> None:
    """Chunked local attention of 8-token chunks, block size 4: computing token 8 starts
    a chunk, so blocks 0 and 1 go back; a cache hit needs only the last chunk's blocks."""
    kind = ChunkedLocalAttention(8)
    assert [kind.first_needed_token(p) for p in (0, 7, 8, 15, 16)] == [0, 0, 8, 8, 16]
    kv = KVCacheManager(12, 4, groups=(KVGroupSpec(kind, (0,)),))
    null = kv.null_block
    tokens = list(range(100, 124))
    for n in range(1, 21):
        assert kv.allocate_slots(0, n)
        kv.cache_computed_blocks(0, tokens, n)
        if n == 9:
            assert kv.block_tables(0) == ((null, null, 2),)
    assert kv.block_tables(0) == ((null, null, null, null, 4),)
    assert kv.num_dropped_blocks == 4
    kv.free(0)
    # Another request evicts blocks 0..3; the token after the 20 cached reads only 4.
    assert kv.allocate_slots(1, 44) and kv.allocator.num_evictions == 4
    kv.free(1)
    (hit,) = kv.lookup_prefix([tokens[:21]])
    assert hit.tables == ((null, null, null, null, 4),)
    assert kv.blocks_for_tokens(1000, chunk=1) == 3


@pytest.mark.parametrize("block_size", [1, 4])
@pytest.mark.parametrize("prompt_len", [1, 4, 9, 12, 13])
def test_the_routers_hashes_are_the_managers(block_size: int, prompt_len: int) -> None:
    """What the router hashes of a prompt is the chain the manager caches and looks up."""
    kv = KVCacheManager(16, block_size)
    prompt = [(7 * i) % 97 + 1 for i in range(prompt_len)]
    assert kv.allocate_slots(0, prompt_len)
    kv.cache_computed_blocks(0, prompt, prompt_len)
    hashes = list(kv.lookup_prefix([prompt])[0].hashes)
    assert hashes == prompt_block_hashes(prompt, block_size)
    assert len(hashes) == (prompt_len - 1) // block_size
    parent = b""
    for i, block_hash in enumerate(hashes):
        parent = hash_block(parent, prompt[i * block_size : (i + 1) * block_size])
        assert block_hash == parent
