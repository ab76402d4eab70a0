"""The mixed-batch LoRA product: each adapter's low-rank delta on its own rows only.

The base projections run once for every row; then, per layer and projection, the rows
under an adapter are gathered into tiles of up to T rows of one adapter each (Punica's
SGMV grouping, made of batched matrix products): x [tiles, T, in] times the tile's A^T
and then its B^T, and the results added into their rows of the output. Base rows take no
work. The grouping (`RowTiles`) is built once per step with tensor ops, no loop over rows,
and shared by every layer and projection. The step's adapters are stacked per projection
(`AdapterStacks`): A [layers, adapters, R, in] and, per target, B^T [layers, adapters,
r, out] (stored transposed: the product reads it in order), each adapter's rank padded
with zeros to the step's largest. A fused projection's targets share one A product (their
ranks side by side in R); each target's B product then writes its own slice of the
output. Padding adds exact zeros.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedllm.lora.adapter import target_shapes, unpack
from pagedllm.lora.peft_config import LoRAConfig
from pagedllm.model.config import ModelConfig
from pagedllm.model.linear_deltas import Site

# The decoder layer's fused projections and the targets in each, in output order.
SITE_TARGETS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
# Rows of one adapter in a tile at most: a long prefill splits into several tiles, while
# a decode step's few rows per adapter make one tile each.
MAX_TILE_ROWS = 64


@dataclass(frozen=True)
class TargetB:
    """One target's B^T in a fused projection: rank columns [r_at, r_at + r) of the A
    product, output columns [out_at, out_at + out)."""

    r_at: int
    out_at: int
    bt: torch.Tensor  # [layers, adapters, r, out]


@dataclass(frozen=True)
class SiteStack:
    a: torch.Tensor  # [layers, adapters, R, in]
    bs: tuple[TargetB, ...]


@dataclass(frozen=True)
class AdapterStacks:
    """The weights of a step's adapters (slot i: the i-th of `lora_ids`), per projection
    that any of them targets."""

    lora_ids: tuple[int, ...]
    sites: dict[str, SiteStack]


def build_stacks(
    cfg: ModelConfig,
    adapters: Sequence[tuple[LoRAConfig, torch.Tensor]],
    lora_ids: tuple[int, ...],
) -> AdapterStacks:
    """Stack `adapters` (each its config and its packed layers [layers, >= elems], as
    LoRAAdapter.pack lays them out) into one slot each, on the packed tensors' device."""
    shapes = target_shapes(cfg)
    layers, n = cfg.num_hidden_layers, len(adapters)
    device = adapters[0][1].device
    views = [unpack(p, cfg, c.r, c.targets) for c, p in adapters]
    sites: dict[str, SiteStack] = {}
    for site, targets in SITE_TARGETS.items():
        # Each target's rank span: the largest rank of an adapter on it (0: none is).
        ranks = [max((c.r for c, _ in adapters if t in c.targets), default=0) for t in targets]
        if not any(ranks):
            continue
        n_in = shapes[targets[0]][0]
        a = torch.zeros(layers, n, sum(ranks), n_in, device=device)
        bs = []
        r_at, out_at = 0, 0
        for t, span in zip(targets, ranks, strict=True):
            n_out = shapes[t][1]
            if span:
                bt = torch.zeros(layers, n, span, n_out, device=device)
                for slot, ((c, _), (va, vb)) in enumerate(zip(adapters, views, strict=True)):
                    if t in c.targets:
                        a[:, slot, r_at : r_at + c.r] = va[t]
                        bt[:, slot, : c.r] = vb[t].transpose(1, 2)
                bs.append(TargetB(r_at, out_at, bt))
            r_at, out_at = r_at + span, out_at + n_out
        sites[site] = SiteStack(a, tuple(bs))
    return AdapterStacks(lora_ids, sites)


@dataclass(frozen=True)
class RowTiles:
    """The step's rows grouped into tiles of one adapter each."""

    gather: torch.Tensor  # [tiles * rows_per_tile]: the row each tile position reads
    tile_slot: torch.Tensor | None  # [tiles]: each tile's adapter slot (None: tile i = slot i)
    # positions in the flattened tiles that hold a real row (None: all, no padding) ...
    src: torch.Tensor | None
    dst: torch.Tensor  # ... and the rows they belong to
    tiles: int
    rows_per_tile: int


def plan_rows(
    row_slots: torch.Tensor, num_slots: int, max_tile: int = MAX_TILE_ROWS
) -> RowTiles | None:
    """Tiles for `row_slots` [rows] (each row's adapter slot; -1: the base), or None when
    no row runs under an adapter."""
    rows = torch.nonzero(row_slots >= 0).flatten()
    if rows.numel() == 0:
        return None
    slots = row_slots[rows]
    order = torch.argsort(slots, stable=True)
    rows, slots = rows[order], slots[order]
    counts = torch.bincount(slots, minlength=num_slots)
    per_tile = min(int(counts.max()), max_tile)
    tiles_of = (counts + per_tile - 1) // per_tile  # each slot's tiles
    first_tile = torch.cumsum(tiles_of, 0) - tiles_of
    first_row = torch.cumsum(counts, 0) - counts
    rank = torch.arange(rows.numel(), device=rows.device) - first_row[slots]
    flat = (first_tile[slots] + rank // per_tile) * per_tile + rank % per_tile
    tiles = int(tiles_of.sum())
    gather = torch.zeros(tiles * per_tile, dtype=torch.long, device=rows.device)
    gather[flat] = rows
    identity = tiles == num_slots and bool((tiles_of == 1).all())
    tile_slot = (
        None
        if identity
        else torch.repeat_interleave(torch.arange(num_slots, device=rows.device), tiles_of)
    )
    src = None if tiles * per_tile == rows.numel() else flat  # unpadded: flat is 0, 1, ...
    return RowTiles(gather, tile_slot, src, rows, tiles, per_tile)


class LoRABatch:
    """A step's LinearDeltas (model/linear_deltas.py): its adapters' stacks and its rows'
    tiles."""

    def __init__(self, stacks: AdapterStacks, tiles: RowTiles) -> None:
        self.stacks = stacks
        self.tiles = tiles

    def add(self, layer: int, site: Site, x: torch.Tensor, out: torch.Tensor) -> None:
        stack = self.stacks.sites.get(site)
        if stack is None:
            return
        tiles, slots = self.tiles, self.tiles.tile_slot
        a = stack.a[layer] if slots is None else stack.a[layer][slots]
        xg = x[tiles.gather].view(tiles.tiles, tiles.rows_per_tile, -1).to(a.dtype)
        h = torch.bmm(xg, a.transpose(1, 2))  # [tiles, T, R]
        whole = len(stack.bs) == 1 and stack.bs[0].bt.shape[-1] == out.shape[1]
        for target in stack.bs:
            bt = target.bt[layer] if slots is None else target.bt[layer][slots]
            r, n_out = bt.shape[1:]
            d = torch.bmm(h[:, :, target.r_at : target.r_at + r], bt).view(-1, n_out)
            part = out if whole else out[:, target.out_at : target.out_at + n_out]
            d = d if tiles.src is None else d[tiles.src]
            part.index_add_(0, tiles.dst, d.to(out.dtype))
