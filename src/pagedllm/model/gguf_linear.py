"""Linear layers on GGUF weights as the file stores them (`quantization="gguf"`).

A `GGUFWeight` is one weight matrix as its raw blocks: a uint8 tensor [out, bytes per row]
over the file's memory map (never an fp32 copy), with its GGML type. A `GGUFLinear`
computes x @ W^T for W stacked by rows from such parts (a fused q/k/v or gate/up): each
part is multiplied where it lies (joining parts would copy them off the map, and resident
memory would hold both). Where the kernels build, a layer whose parts are Q4_1 or Q4_K in
whole groups of 16 rows takes them interleaved (kernels/gguf_blocks.py `interleave`): one
copy per tensor at load, whose source pages in the map are handed back, so resident
memory still holds each weight once. It calls the compiled `gguf_linear_parts` op
(kernels/gguf_blocks.py), which quantizes the activations per block as llama.cpp does,
once per kind of block, unpacks each weight block once for several input rows where the
type has a multi-row kernel, and splits all parts' rows over the threads at once; where the
kernels do not build, it computes the same product in pure torch: activations quantized
and dequantized the op's way, weights dequantized per call.
`embed_rows` dequantizes only the looked-up rows of an embedding table.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import nn

from pagedllm.kernels.gguf_blocks import (
    INTERLEAVED_GROUP_ROWS,
    INTERLEAVED_TYPES,
    KERNEL_TYPES,
    interleave,
)

# The types whose activations the op quantizes to Q8_K (256-value blocks); Q8_0/Q8_1
# (32-value blocks) for the other quantized types; F16/BF16/F32 multiply fp32 inputs.
K_QUANTS = (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K)
FLOAT_TYPES = (GGMLQuantizationType.F16, GGMLQuantizationType.BF16, GGMLQuantizationType.F32)
# The types a weight kept as blocks may have: the kernels' types, and F32 (used as stored).
STORED_TYPES = (*KERNEL_TYPES, GGMLQuantizationType.F32)


@dataclass(frozen=True, eq=False)
class GGUFWeight:
    """A weight matrix [out_features, in_features] as its raw GGML blocks."""

    # uint8 [out_features, bytes per row], or interleaved [out_features / 16, 16, bytes per row]
    blocks: torch.Tensor
    ggml_type: GGMLQuantizationType
    in_features: int

    @property
    def interleaved(self) -> bool:
        return self.blocks.dim() == 3

    @property
    def shape(self) -> tuple[int, int]:
        return (
            self.blocks.shape[0] * (INTERLEAVED_GROUP_ROWS if self.interleaved else 1),
            self.in_features,
        )

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The weight (or only its `rows`) in fp32."""
        blocks = (
            interleave(self.blocks, self.ggml_type, inverse=True)
            if self.interleaved
            else self.blocks
        )
        blocks = blocks if rows is None else blocks[rows]
        if self.ggml_type == GGMLQuantizationType.F32:
            return blocks.view(torch.float32).reshape(-1, self.in_features)
        values = gguf.quants.dequantize(blocks.numpy(), self.ggml_type)
        return torch.from_numpy(np.asarray(values, dtype=np.float32)).reshape(-1, self.in_features)


def quantized_activations(x: torch.Tensor, ggml_type: GGMLQuantizationType) -> torch.Tensor:
    """fp32 x as the op sees it before multiplying it with `ggml_type` weights: quantized
    into 8-bit blocks and dequantized. Q8_0/Q8_1: x * (127 / max|x|) rounded half to even,
    d = fp16(max|x| / 127); Q8_K: x * (-127 / the value of largest magnitude), rounded,
    capped at 127, d = 1 / that factor."""
    if ggml_type in FLOAT_TYPES:
        return x
    rows, width = x.shape
    block = 256 if ggml_type in K_QUANTS else 32
    v = x.reshape(rows, width // block, block)
    if ggml_type in K_QUANTS:
        peak = v.gather(-1, v.abs().argmax(dim=-1, keepdim=True))
        nonzero = peak != 0
        iscale = torch.where(nonzero, -127.0 / torch.where(nonzero, peak, 1.0), 0.0)
        q = torch.round(v * iscale).clamp(max=127)
        d = torch.where(nonzero, 1.0 / torch.where(nonzero, iscale, 1.0), 0.0)
    else:
        amax = v.abs().amax(dim=-1, keepdim=True)
        nonzero = amax != 0
        inv = torch.where(nonzero, 127.0 / torch.where(nonzero, amax, 1.0), 0.0)
        q = torch.round(v * inv)
        d = (amax / 127.0).half().float()
    return (q * d).reshape(rows, width)


class GGUFLinear(nn.Module):
    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, kernels: Any = None
    ) -> None:
        """Empty until `load`; `kernels`: the compiled kernels' namespace (None: pure
        torch). The bias, if any, is fp32 and filled like a dense layer's."""
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.parts: list[GGUFWeight] = []
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.kernels = kernels

    def load(self, parts: Sequence[GGUFWeight]) -> None:
        """Take W as the rows of `parts` stacked in order."""
        shapes = [p.shape for p in parts]
        rows = sum(s[0] for s in shapes)
        if rows != self.out_features or any(s[1] != self.in_features for s in shapes):
            raise ValueError(
                f"GGUF weights of shapes {shapes} do not stack to "
                f"[{self.out_features}, {self.in_features}]"
            )
        self.parts = list(parts)
        # The op splits a layer with interleaved parts over its threads in whole groups,
        # so every part's rows must come in groups, whatever its type.
        if self.kernels is not None and all(
            p.shape[0] % INTERLEAVED_GROUP_ROWS == 0 for p in parts
        ):
            self.parts = [_interleaved(p) for p in parts]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float().reshape(-1, self.in_features).contiguous()
        if self.kernels is not None and all(p.ggml_type in KERNEL_TYPES for p in self.parts):
            blocks = [p.blocks for p in self.parts]
            kinds = [int(p.ggml_type) for p in self.parts]
            # "auto" twice: VNNI where the CPU has it; the gemm method from
            # policy.GGUF_GEMM_MIN_ROWS rows on (the same bits as one row at a time).
            out = self.kernels.gguf_linear_parts(x, blocks, kinds, "auto", "auto")
        else:
            outs = [
                F.linear(quantized_activations(x, p.ggml_type), p.dequantize()) for p in self.parts
            ]
            out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        return out if self.bias is None else out + self.bias


# Each weight's interleaved copy while the weight lives: two models over the same loaded
# weights (a draft that is the target's own file) share one copy, as they share the map.
_INTERLEAVED: weakref.WeakKeyDictionary[GGUFWeight, GGUFWeight] = weakref.WeakKeyDictionary()


def _interleaved(weight: GGUFWeight) -> GGUFWeight:
    """`weight` in the interleaved layout if its type has it (its source pages released)."""
    if weight.ggml_type not in INTERLEAVED_TYPES or weight.interleaved:
        return weight
    if (done := _INTERLEAVED.get(weight)) is None:
        blocks = interleave(weight.blocks.contiguous(), weight.ggml_type, release_source=True)
        done = _INTERLEAVED[weight] = GGUFWeight(blocks, weight.ggml_type, weight.in_features)
    return done


def embed_rows(ids: torch.Tensor, table: GGUFWeight, kernels: Any = None) -> torch.Tensor:
    """The embedding rows of token `ids` [T] -> [T, hidden], dequantizing only those rows:
    by the compiled op where `kernels` are given and take the table (no buffer beyond the
    rows; the gguf package's numpy held some 55 MB for a 512-token prompt's rows), else
    each distinct row once by the gguf package."""
    if kernels is not None and table.ggml_type in KERNEL_TYPES and not table.interleaved:
        return kernels.gguf_dequantize_rows(table.blocks, ids, int(table.ggml_type))
    unique, inverse = torch.unique(ids, return_inverse=True)
    return table.dequantize(unique)[inverse]
