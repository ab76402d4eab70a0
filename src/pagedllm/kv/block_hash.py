"""The prefix cache's block hash: one rule for the manager, the KV events and the router.

A full block's hash chains its parent's hash with its own token ids, so equal hashes
mean equal prefixes. The first block's parent is the chain's root: b"" for the base
model, `root_hash(lora_id)` under a LoRA adapter, so that a prefix computed under one
adapter never serves another. A cache hit covers at most the full
blocks before the one holding the last token (`reusable_blocks`): the step that admits
a sequence then still computes a token and produces logits. The Ray prefix router hashes
a prompt with `prompt_block_hashes` to ask which replica holds it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from typing import NamedTuple


class HashedBlock(NamedTuple):
    """One full block of a sequence: its parent's hash, its tokens, its own hash."""

    parent_hash: bytes
    token_ids: Sequence[int]
    block_hash: bytes


def hash_block(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """Chained hash of a full block: its parent's hash and its own token ids."""
    h = hashlib.sha256(parent_hash)
    h.update(b",".join(str(t).encode() for t in token_ids))
    return h.digest()[:16]


def root_hash(lora_id: int = 0) -> bytes:
    """The parent hash of a sequence's first block under adapter `lora_id` (0: none)."""
    if lora_id == 0:
        return b""
    return hashlib.sha256(f"lora:{lora_id}".encode()).digest()[:16]


def reusable_blocks(num_tokens: int, block_size: int) -> int:
    """Leading full blocks of a sequence of `num_tokens` tokens that a cache hit may
    cover: every one but the block holding the last token."""
    return max(0, num_tokens - 1) // block_size


def hashed_blocks(
    token_ids: Sequence[int],
    block_size: int,
    stop: int,
    start: int = 0,
    parent_hash: bytes = b"",
) -> Iterator[HashedBlock]:
    """The full blocks `start`..`stop`-1 of `token_ids`, hashed one after the other as
    they are read (a caller that stops early hashes no more); `parent_hash`: the hash of
    block `start` - 1."""
    for i in range(start, stop):
        tokens = token_ids[i * block_size : (i + 1) * block_size]
        block_hash = hash_block(parent_hash, tokens)
        yield HashedBlock(parent_hash, tokens, block_hash)
        parent_hash = block_hash


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, lora_id: int = 0) -> list[bytes]:
    """The chained hashes of the prompt's blocks a cache hit could cover (under adapter
    `lora_id`)."""
    stop = reusable_blocks(len(token_ids), block_size)
    root = root_hash(lora_id)
    return [b.block_hash for b in hashed_blocks(token_ids, block_size, stop, parent_hash=root)]
