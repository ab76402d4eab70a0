"""LinearDeltas: what a decoder layer adds to its linear layers' outputs, per row.

LoRA adapters (lora/batch.py) implement it: after each fused projection the layer hands
over its input and its output, and the deltas of the rows that run under an adapter are
added into the output in place (into the q/k/v or gate/up slices of a fused output). Q/K/V
deltas land before the q/k norms and rotary, where PEFT adds them to q_proj's output.
The model never imports the implementations; `forward(..., deltas=None)` costs nothing.
"""

from __future__ import annotations

from typing import Literal, Protocol

import torch

# The layer's fused projections: q/k/v, o_proj, gate/up, down.
Site = Literal["qkv", "o_proj", "gate_up", "down"]


class LinearDeltas(Protocol):
    def add(self, layer: int, site: Site, x: torch.Tensor, out: torch.Tensor) -> None:
        """Add to `out` [rows, out] (in place) the deltas of projection `site` of decoder
        layer `layer` for its input `x` [rows, in]."""
        ...
