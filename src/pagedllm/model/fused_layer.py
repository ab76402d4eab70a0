"""A Llama decoder layer with int8 or GGUF linear layers, run as one compiled call.

The compiled `int8_decoder_layer` and `gguf_decoder_layer` ops (kernels/csrc/
decoder_layer.cpp) chain the kernels DecoderLayer.forward calls one by one (norms, the
linear layers, rotary, paged attention, SiLU-and-multiply) in the same order on the same
tensors, so their output is the same bits; they save the dozen Python calls and dispatches
between them, about as much time as the layer's arithmetic at batch 1. They apply to the
plain Llama layer only (no q/k norms, no sandwich norms, no GELU, no tensor parallelism),
with the compiled CPU attention; any other layer keeps the step-by-step forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.attention.cpu import CpuPagedAttention
from pagedllm.attention.cpu_plan import CpuPlan
from pagedllm.attention.timed import TimedAttention
from pagedllm.kernels.gguf_blocks import KERNEL_TYPES
from pagedllm.model.gguf_linear import GGUFLinear
from pagedllm.model.layer_ops import CompiledLayerOps
from pagedllm.model.linear import Int8Linear

_NONE = torch.empty(0)  # "no bias" / "no panels" in the op's weight list


def cpu_attention(backend: Any) -> CpuPagedAttention | None:
    """The compiled CPU backend under `backend` (itself, or what a TimedAttention wraps)."""
    inner = backend.inner if isinstance(backend, TimedAttention) else backend
    return inner if isinstance(inner, CpuPagedAttention) else None


def _linears(layer: nn.Module) -> tuple[Any, Any, Any, Any]:
    return layer.qkv, layer.o_proj, layer.gate_up, layer.down


def _plain(layer: nn.Module) -> bool:
    """Whether `layer` is the plain Llama layer the compiled ops compute."""
    extras = (layer.q_norm, layer.attn_out_norm, layer.mlp_out_norm, layer.parallel)
    return (
        all(part is None for part in extras)
        and not layer.gelu
        and isinstance(layer.ops, CompiledLayerOps)
        and cpu_attention(layer.attention) is not None
        and layer.rotary.cos.dtype == torch.float32
    )


class FusedLayer:
    """What both compiled layers take besides their weights: the step's paged-attention
    inputs and the layer's shape."""

    def __init__(self, layer: nn.Module, ops: Any) -> None:
        """`layer`: a DecoderLayer (model/llama.py) that `applies`; `ops`: the kernels."""
        self.layer = layer
        self.ops = ops  # torch.ops.pagedllm_cpu
        attention = cpu_attention(layer.attention)
        assert attention is not None
        self.scale = attention.scale

    def _paged(self, kv_cache: Any, plan: CpuPlan) -> tuple[torch.Tensor, ...]:
        meta = plan.meta
        return (
            kv_cache[0],
            kv_cache[1],
            meta.slot_mapping,
            meta.block_tables,
            meta.query_start_loc,
            meta.context_lens,
            plan.items,
            plan.merges,
        )

    def _shape(self) -> tuple[int, int, int, float, float, int]:
        layer = self.layer
        heads = (layer.num_heads, layer.num_kv_heads, layer.head_dim)
        return (*heads, layer.input_layernorm.eps, self.scale, layer.window or 0)


class FusedInt8Layer(FusedLayer):
    def __init__(self, layer: nn.Module, ops: Any) -> None:
        super().__init__(layer, ops)
        self._weights: tuple[list[torch.Tensor], str] | None = None  # at the first call

    @staticmethod
    def applies(layer: nn.Module) -> bool:
        return _plain(layer) and all(
            isinstance(m, Int8Linear) and m.ops is not None for m in _linears(layer)
        )

    def __call__(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        kv_cache: Any,
        plan: CpuPlan,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.layer
        weights, kernels = self._weights or self._gather()
        rotary = (positions, layer.rotary.cos, layer.rotary.sin)
        return self.ops.int8_decoder_layer(
            hidden.float().contiguous(),
            residual,
            *rotary,
            weights,
            kernels,
            *self._paged(kv_cache, plan),
            *self._shape(),
        )

    def _gather(self) -> tuple[list[torch.Tensor], str]:
        """The op's weight list and GEMM names, gathered once, at the first call: after the
        load has chosen each layer's GEMM and packed its panels (gathering them at every
        call cost about 20 us a layer, some 3% of a batch-1 step)."""
        layer = self.layer
        weights = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
        for m in _linears(layer):
            bias = _NONE if m.bias is None else m.bias
            panels = _NONE if m.panels is None else m.panels
            weights += [m.inv_smooth, m.weight_t, m.weight_scale, m.weight_sums, bias, panels]
        self._weights = weights, ",".join(m.gemm for m in _linears(layer))
        return self._weights


class FusedGGUFLayer(FusedLayer):
    def __init__(self, layer: nn.Module, ops: Any) -> None:
        super().__init__(layer, ops)
        linears = _linears(layer)
        parts = [part for m in linears for part in m.parts]
        self.blocks = [part.blocks for part in parts]
        self.ggml_types = [int(part.ggml_type) for part in parts]
        self.parts = [len(m.parts) for m in linears]

    @staticmethod
    def applies(layer: nn.Module) -> bool:
        linears = _linears(layer)
        return (
            _plain(layer)
            and all(isinstance(m, GGUFLinear) and m.kernels is not None for m in linears)
            and all(m.bias is None for m in linears[1:])
            and all(p.ggml_type in KERNEL_TYPES for m in linears for p in m.parts)
        )

    def __call__(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        kv_cache: Any,
        plan: CpuPlan,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.layer
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        return self.ops.gguf_decoder_layer(
            hidden.float().contiguous(),
            residual,
            positions,
            layer.rotary.cos,
            layer.rotary.sin,
            *norms,
            self.blocks,
            self.ggml_types,
            self.parts,
            layer.qkv.bias,
            *self._paged(kv_cache, plan),
            *self._shape(),
        )
