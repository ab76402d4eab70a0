"""Layer groups: which layers share one block table, and how many blocks a group holds.

Layers are grouped by attention kind (kv/attention_kinds.py: full attention, or a
sliding window of W tokens).
All groups draw on one pool with one page size, so every group has the same number of
layers (`group_size`, the gcd of the per-kind layer counts): a kind with more layers is
split into several groups. Physical block b then holds K/V of `group_size` layers, and
layer `groups[g].layers[j]` keeps its K/V in slot j of the blocks group g's tables name.
A model of one kind (or the hybrid manager switched off) is one group of every layer;
its window, if every layer has the same one, still lets the group drop old blocks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pagedllm.kv.attention_kinds import AttentionKind, FullAttention, attention_kind
from pagedllm.validation import check_int


@dataclass(frozen=True)
class KVGroupSpec:
    """One group: the layers sharing a block table, and their attention kind."""

    kind: AttentionKind
    layers: tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.kind, AttentionKind):
            raise ValueError(f"a group's kind must be an AttentionKind, got {self.kind!r}")
        if not self.layers:
            raise ValueError("a layer group needs at least one layer")
        if len(set(self.layers)) != len(self.layers) or min(self.layers) < 0:
            raise ValueError(f"a group's layers must be distinct indices >= 0, got {self.layers}")

    @property
    def window(self) -> int | None:
        """The group's window (None: full attention), as the engine's figures show it."""
        return self.kind.window


def group_layers(
    layer_windows: Sequence[int | None] | None, num_layers: int, hybrid: bool = True
) -> tuple[KVGroupSpec, ...]:
    """The layer groups of a model whose layer i has window `layer_windows[i]` (None: no
    per-layer windows, every layer full). Full attention first, then each window kind by
    its first layer. `hybrid=False`: one group of every layer, allocated as full
    attention (the layers still compute over their own windows)."""
    check_int(num_layers, "num_layers", min=1)
    windows = list(layer_windows) if layer_windows is not None else [None] * num_layers
    if len(windows) != num_layers:
        raise ValueError(f"layer_windows has {len(windows)} entries for {num_layers} layers")
    if not hybrid:
        return (KVGroupSpec(FullAttention(), tuple(range(num_layers))),)
    kinds: dict[int | None, list[int]] = {}
    if None in windows:
        kinds[None] = []
    for layer, window in enumerate(windows):
        kinds.setdefault(window, []).append(layer)
    size = math.gcd(*(len(layers) for layers in kinds.values()))
    return tuple(
        KVGroupSpec(attention_kind(window), tuple(layers[i : i + size]))
        for window, layers in kinds.items()
        for i in range(0, len(layers), size)
    )


def group_size(groups: Sequence[KVGroupSpec]) -> int:
    """Layers per group (the same for every group: one page size)."""
    sizes = {len(g.layers) for g in groups}
    if len(sizes) != 1:
        raise ValueError(f"every layer group must have the same number of layers, got {sizes}")
    return sizes.pop()


def needs_null_block(groups: Sequence[KVGroupSpec]) -> bool:
    """Whether some group gives back leading blocks (their entries are the null block)."""
    return any(g.kind.drops_blocks for g in groups)


def kv_bytes_per_sequence(
    groups: Sequence[KVGroupSpec],
    num_tokens: int,
    block_size: int,
    layer_token_bytes: int,
    chunk: int | None = None,
) -> int:
    """Bytes of K/V one sequence of `num_tokens` tokens holds at most, computed `chunk`
    tokens a step (default: one token, a decode), at `layer_token_bytes` bytes of K and V
    per token and layer."""
    chunk = 1 if chunk is None else chunk
    blocks = sum(g.kind.blocks_held(num_tokens, block_size, chunk) for g in groups)
    return blocks * block_size * group_size(groups) * layer_token_bytes
