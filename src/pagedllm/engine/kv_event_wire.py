"""The KV-event wire format for external routers: vLLM's, so that its subscribers work.

One engine step's prefix-cache changes travel as one `KVEventBatch`, encoded with msgpack
(msgspec) as arrays: a batch is `[ts, [event, ...]]` (plus `data_parallel_rank` when set),
and an event is a tagged array whose first element names its kind:

  ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
   medium, lora_name]
  ["BlockRemoved", block_hashes, medium]
  ["AllBlocksCleared"]

Block hashes are pagedllm's own: the first 16 bytes of the chained sha256 of
kv/block_hash.py's `hash_block` (msgpack bin, not vLLM's ints), with the chain starting
from its root (sent as `parent_block_hash` nil): the empty parent b"" for the base model,
`root_hash(lora_id)` for blocks computed under a LoRA adapter, whose BlockStored carries
that `lora_id` (nil for the base model): a prefix is shared within an adapter only. A
BlockStored carries the token ids of all its blocks (`block_size` each, in order, each
block the parent of the next), so a subscriber can check or rebuild every hash:
`hash_block(parent or root_hash(lora_id or 0), tokens)`. `medium` and `lora_name` are
always nil: the engine has one pool. Each ZeroMQ message is three frames: topic, an
8-byte big-endian sequence number (0, 1, 2, ... per publisher: a gap means batches were
lost), the payload.
"""

from __future__ import annotations

from typing import Any

import msgspec


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """One change of the prefix cache; the tag is the class name."""


class BlockStored(KVCacheEvent):
    """Consecutive full blocks of one sequence joined the prefix cache."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None  # the hash before the first block; None at the start
    token_ids: list[int]  # block_size tokens per block, blocks in order
    block_size: int
    # No defaults: omit_defaults would leave them off the wire, and vLLM's layout has them.
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    """Blocks whose cached content is gone (their physical block was reused)."""

    block_hashes: list[bytes]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    """The prefix cache forgot every entry."""


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float  # time.time() at the end of the step
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def decoder() -> msgspec.msgpack.Decoder[KVEventBatch]:
    return msgspec.msgpack.Decoder(KVEventBatch)


def apply(cached: set[bytes], batch: KVEventBatch) -> None:
    """Replay a batch onto a subscriber's set of one engine's cached block hashes."""
    for event in batch.events:
        if isinstance(event, BlockStored):
            cached.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            cached.difference_update(event.block_hashes)
        else:
            cached.clear()


def as_plain(batch: KVEventBatch) -> Any:
    """The batch as msgpack sees it (lists and scalars), for logs and tests."""
    return msgspec.msgpack.decode(msgspec.msgpack.encode(batch))
