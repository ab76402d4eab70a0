"""AttentionMetadata: everything attention needs about one step's flat batch of tokens.

Built once per step by the model runner and passed down the forward as an argument (no
global context). The batch is flat: sequence i's new tokens are rows
`query_start_loc[i]:query_start_loc[i+1]`. It holds only what every backend reads; what
one backend alone needs (the reference's padded groups, a kernel's work list or tile map)
that backend builds from these fields in its `prepare(meta)`, once per step.

A model whose layers form several KV layer groups (kv/groups.py) gets one metadata per
group, bundled with the layer -> group map (`GroupedAttentionMetadata`): the groups share
positions, query offsets, context lengths and logits rows, and differ in block tables
and slot mapping.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] physical slot of each new token's K/V
    positions: torch.Tensor  # [T]
    query_start_loc: torch.Tensor  # [B+1]
    context_lens: torch.Tensor  # [B]
    block_tables: torch.Tensor  # [B, max_blocks]
    logits_indices: torch.Tensor  # [R] rows whose logits are needed
    block_size: int
    num_tokens: int
    max_query_len: int
    max_context_len: int
    dtype: torch.dtype  # the model's compute dtype
    # The same three on the host (the very tensors on a CPU): backends plan a step there
    # without waiting for the device.
    host_query_start_loc: torch.Tensor
    host_context_lens: torch.Tensor
    host_block_tables: torch.Tensor

    @property
    def device(self) -> torch.device:
        return self.slot_mapping.device


def _pad(rows: Sequence[Sequence[int]], width: int) -> torch.Tensor:
    out = torch.zeros((len(rows), max(width, 1)), dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            out[i, : len(row)] = torch.as_tensor(row, dtype=torch.long)
    return out


def build_attention_metadata(
    start_positions: Sequence[int],
    query_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    logits_seq_indices: Sequence[int],
    block_size: int,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> AttentionMetadata:
    """Metadata for sequences that compute `query_lens[i]` tokens from `start_positions[i]`,
    with block tables as lists (see `metadata_from_tables` for a table tensor)."""
    tables = _pad(block_tables, max((len(t) for t in block_tables), default=1))
    return metadata_from_tables(
        start_positions, query_lens, tables, logits_seq_indices, block_size, device, dtype
    )


def metadata_from_tables(
    start_positions: Sequence[int],
    query_lens: Sequence[int],
    tables: torch.Tensor,
    logits_seq_indices: Sequence[int],
    block_size: int,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> AttentionMetadata:
    """Metadata for sequences that compute `query_lens[i]` tokens from `start_positions[i]`;
    `tables`: the host tensor [sequences, entries] of their block tables (padded with 0),
    taken as the metadata's own."""
    # numpy, then shared with torch: a few dozen operations on arrays of a few elements,
    # each several times cheaper in numpy than in torch.
    num_seqs = len(query_lens)
    starts = np.asarray(start_positions, dtype=np.int64)
    qlens = np.asarray(query_lens, dtype=np.int64)
    qsl = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(qlens, out=qsl[1:])
    num_tokens = int(qsl[-1])
    seq_of_token = np.repeat(np.arange(num_seqs), qlens)
    positions = starts[seq_of_token] + np.arange(num_tokens) - qsl[:-1][seq_of_token]
    slot_mapping = _slots(tables.numpy(), seq_of_token, positions, block_size)
    context_lens = starts + qlens
    logits_indices = qsl[1:][np.asarray(logits_seq_indices, dtype=np.int64)] - 1
    slot_mapping, positions, logits_indices, qsl, context_lens = map(
        torch.from_numpy, (slot_mapping, positions, logits_indices, qsl, context_lens)
    )
    return AttentionMetadata(
        slot_mapping=slot_mapping.to(device),
        positions=positions.to(device),
        query_start_loc=qsl.to(device),
        context_lens=context_lens.to(device),
        block_tables=tables.to(device),
        logits_indices=logits_indices.to(device),
        block_size=block_size,
        num_tokens=num_tokens,
        max_query_len=max(query_lens, default=0),
        max_context_len=int(context_lens.max()) if num_seqs else 0,
        dtype=dtype,
        host_query_start_loc=qsl,
        host_context_lens=context_lens,
        host_block_tables=tables,
    )


@dataclass(frozen=True)
class GroupedAttentionMetadata:
    """One step's metadata for each layer group, and the group of each layer."""

    groups: tuple[AttentionMetadata, ...]
    layer_group: tuple[int, ...]  # layer index -> its group

    def __post_init__(self) -> None:
        if not self.groups or any(not 0 <= g < len(self.groups) for g in self.layer_group):
            raise ValueError("every layer must name one of the step's metadata groups")

    @classmethod
    def of(cls, meta: AttentionMetadata | GroupedAttentionMetadata, num_layers: int) -> Any:
        """`meta` as grouped metadata: plain metadata serves every layer as one group."""
        if isinstance(meta, GroupedAttentionMetadata):
            return meta
        return cls((meta,), (0,) * num_layers)

    @property
    def positions(self) -> torch.Tensor:
        return self.groups[0].positions

    @property
    def logits_indices(self) -> torch.Tensor:
        return self.groups[0].logits_indices


def build_grouped_metadata(
    start_positions: Sequence[int],
    query_lens: Sequence[int],
    block_tables: Sequence[torch.Tensor],
    logits_seq_indices: Sequence[int],
    block_size: int,
    layer_group: Sequence[int],
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> GroupedAttentionMetadata:
    """Metadata per layer group: `block_tables[g]` is the host tensor [sequences, entries]
    of the sequences' tables of group g (padded with 0)."""
    num_groups = max(layer_group) + 1
    first = metadata_from_tables(
        start_positions,
        query_lens,
        block_tables[0],
        logits_seq_indices,
        block_size,
        device,
        dtype,
    )
    metas = [first]
    if num_groups > 1:
        # Positions, offsets and lengths are the first group's; only the tables differ.
        qsl = first.host_query_start_loc.numpy()
        seq_of_token = np.repeat(np.arange(len(query_lens)), qsl[1:] - qsl[:-1])
        positions = first.positions.cpu().numpy()
        for g in range(1, num_groups):
            tables = block_tables[g]
            slots = _slots(tables.numpy(), seq_of_token, positions, block_size)
            metas.append(
                replace(
                    first,
                    slot_mapping=torch.from_numpy(slots).to(device),
                    block_tables=tables.to(device),
                    host_block_tables=tables,
                )
            )
    return GroupedAttentionMetadata(tuple(metas), tuple(layer_group))


def _slots(
    tables: np.ndarray, seq_of_token: np.ndarray, positions: np.ndarray, block_size: int
) -> np.ndarray:
    """The physical KV slot of each token: its sequence's block at its position, and the
    offset in that block."""
    return tables[seq_of_token, positions // block_size] * block_size + positions % block_size


def query_tile_starts(query_start_loc: np.ndarray, tile: int) -> np.ndarray:
    """[num_tiles, 2]: (sequence, first query row) of each tile of at most `tile` query
    tokens, sequence by sequence."""
    qlens = query_start_loc[1:] - query_start_loc[:-1]
    counts = (qlens + tile - 1) // tile
    seq = np.repeat(np.arange(qlens.size), counts)
    first_tile = np.cumsum(counts) - counts
    row0 = (np.arange(seq.size) - first_tile[seq]) * tile
    return np.stack([seq, row0], axis=1)
