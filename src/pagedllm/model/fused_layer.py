"""A Llama decoder layer with int8 or GGUF linear layers, run as one compiled call.

The compiled `int8_decoder_layer` op (kernels/csrc/decoder_layer.cpp) chains the kernels
DecoderLayer.forward calls one by one (norms, the linear layers, rotary, paged attention,
SiLU-and-multiply) in the same order on the same tensors, so its output is the same bits;
it saves the dozen Python calls and dispatches between them, about as much time as the
layer's arithmetic at batch 1. On GGUF blocks, `gguf_decoder_layers` does the same for all
the model's layers in one call, whose arguments (every layer's weights) are gathered once.
They apply to the plain Llama layer only (no q/k norms, no sandwich norms, no GELU, no
tensor parallelism), with the compiled CPU attention; any other layer keeps the
step-by-step forward.
"""

from __future__ import annotations

from collections.abc import Sequence
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


def _step_inputs(plan: CpuPlan) -> tuple[torch.Tensor, ...]:
    """The step's paged-attention inputs besides the caches."""
    meta = plan.meta
    return (
        meta.slot_mapping,
        meta.block_tables,
        meta.query_start_loc,
        meta.context_lens,
        plan.items,
        plan.merges,
    )


def _shape(layer: nn.Module) -> tuple[int, int, int, float, float, int]:
    """The layer's heads, head size, norm epsilon, attention scale and window (0: none)."""
    attention = cpu_attention(layer.attention)
    assert attention is not None
    heads = (layer.num_heads, layer.num_kv_heads, layer.head_dim)
    return (*heads, layer.input_layernorm.eps, attention.scale, layer.window or 0)


class FusedInt8Layer:
    def __init__(self, layer: nn.Module, ops: Any) -> None:
        """`layer`: a DecoderLayer (model/llama.py) that `applies`; `ops`: the kernels."""
        self.layer = layer
        self.ops = ops  # torch.ops.pagedllm_cpu
        self.shape = _shape(layer)
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
        return self.ops.int8_decoder_layer(
            hidden.float().contiguous(),
            residual,
            positions,
            layer.rotary.cos,
            layer.rotary.sin,
            weights,
            kernels,
            kv_cache[0],
            kv_cache[1],
            *_step_inputs(plan),
            *self.shape,
        )

    def _gather(self) -> tuple[list[torch.Tensor], str]:
        """The op's weight list and GEMM names, gathered once, at the first call: after the
        load has chosen each layer's GEMM and packed its panels (gathering them at every
        call cost about 20 us a layer, some 3% of a batch-1 step)."""
        layer = self.layer
        weights = list(_norms(layer))
        for m in _linears(layer):
            bias = _NONE if m.bias is None else m.bias
            panels = _NONE if m.panels is None else m.panels
            weights += [m.inv_smooth, m.weight_t, m.weight_scale, m.weight_sums, bias, panels]
        self._weights = weights, ",".join(m.gemm for m in _linears(layer))
        return self._weights


class FusedGGUFLayers:
    """Every decoder layer of a model on GGUF blocks, in one compiled call a step: the
    per-layer argument lists are gathered once, at load."""

    def __init__(self, layers: Sequence[nn.Module], ops: Any) -> None:
        """`layers`: the model's DecoderLayers, each of which `applies`; `ops`: the kernels."""
        self.layers = list(layers)
        self.ops = ops  # torch.ops.pagedllm_cpu
        self.shape = _shape(self.layers[0])
        self.rotary = self.layers[0].rotary
        self.norms = [n for layer in self.layers for n in _norms(layer)]
        linears = [m for layer in self.layers for m in _linears(layer)]
        self.blocks = [part.blocks for m in linears for part in m.parts]
        self.ggml_types = [int(part.ggml_type) for m in linears for part in m.parts]
        self.parts = [len(m.parts) for m in linears]
        self.biases = [_NONE if x.qkv.bias is None else x.qkv.bias for x in self.layers]
        # The step's activations, kept from step to step (the op grows it to the largest
        # step's rows): buffers allocated anew each layer left the heap fragmented.
        self.workspace = torch.empty(0)

    @staticmethod
    def applies(layers: Sequence[nn.Module]) -> bool:
        """Whether every layer is a plain Llama layer on GGUF blocks the kernels take, all
        with the first's rotary table, window and heads (one argument list serves all)."""
        first = layers[0]

        def fits(layer: nn.Module) -> bool:
            linears = _linears(layer)
            return (
                _plain(layer)
                and layer.rotary is first.rotary
                and (layer.window, layer.split_heads) == (first.window, first.split_heads)
                and all(isinstance(m, GGUFLinear) and m.kernels is not None for m in linears)
                and all(m.bias is None for m in linears[1:])
                and all(p.ggml_type in KERNEL_TYPES for m in linears for p in m.parts)
            )

        return all(fits(layer) for layer in layers)

    def __call__(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[Any],
        plan: CpuPlan,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ops.gguf_decoder_layers(
            hidden.float().contiguous(),
            positions,
            self.rotary.cos,
            self.rotary.sin,
            self.norms,
            self.blocks,
            self.ggml_types,
            self.parts,
            self.biases,
            [kv[0] for kv in kv_caches],
            [kv[1] for kv in kv_caches],
            *_step_inputs(plan),
            self.workspace,
            *self.shape,
        )


def _norms(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    return layer.input_layernorm.weight, layer.post_attention_layernorm.weight
