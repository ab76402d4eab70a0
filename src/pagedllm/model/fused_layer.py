"""A Llama decoder layer with int8 linear layers, run as one compiled call.

The compiled `int8_decoder_layer` op (kernels/csrc/decoder_layer.cpp) chains the kernels
DecoderLayer.forward calls one by one (norms, int8 products, rotary, paged attention,
SiLU-and-multiply) in the same order on the same tensors, so its output is the same bits;
it saves the dozen Python calls and dispatches between them, about as much time as the
layer's arithmetic at batch 1. It applies to the plain Llama layer only (no q/k norms, no
sandwich norms, no GELU, no tensor parallelism), with the compiled CPU attention; any
other layer keeps the step-by-step forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.attention.cpu import CpuPagedAttention
from pagedllm.attention.cpu_plan import CpuPlan
from pagedllm.attention.timed import TimedAttention
from pagedllm.model.layer_ops import CompiledLayerOps
from pagedllm.model.linear import Int8Linear

_NONE = torch.empty(0)  # "no bias" / "no panels" in the op's weight list


def cpu_attention(backend: Any) -> CpuPagedAttention | None:
    """The compiled CPU backend under `backend` (itself, or what a TimedAttention wraps)."""
    inner = backend.inner if isinstance(backend, TimedAttention) else backend
    return inner if isinstance(inner, CpuPagedAttention) else None


class FusedInt8Layer:
    def __init__(self, layer: nn.Module, ops: Any) -> None:
        """`layer`: a DecoderLayer (model/llama.py) that `applies`; `ops`: the kernels."""
        self.layer = layer
        self.ops = ops  # torch.ops.pagedllm_cpu
        attention = cpu_attention(layer.attention)
        assert attention is not None
        self.scale = attention.scale
        self._weights: tuple[list[torch.Tensor], str] | None = None  # at the first call

    @staticmethod
    def applies(layer: nn.Module) -> bool:
        linears = (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
        plain = (layer.q_norm, layer.attn_out_norm, layer.mlp_out_norm, layer.parallel)
        return (
            all(isinstance(m, Int8Linear) and m.ops is not None for m in linears)
            and all(part is None for part in plain)
            and not layer.gelu
            and isinstance(layer.ops, CompiledLayerOps)
            and cpu_attention(layer.attention) is not None
            and layer.rotary.cos.dtype == torch.float32
        )

    def __call__(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        kv_cache: Any,
        plan: CpuPlan,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        layer, meta = self.layer, plan.meta
        weights, kernels = self._weights or self._gather()
        out, residual = self.ops.int8_decoder_layer(
            hidden.float().contiguous(),
            residual,
            positions,
            layer.rotary.cos,
            layer.rotary.sin,
            weights,
            kernels,
            kv_cache[0],
            kv_cache[1],
            meta.slot_mapping,
            meta.block_tables,
            meta.query_start_loc,
            meta.context_lens,
            plan.items,
            plan.merges,
            layer.num_heads,
            layer.num_kv_heads,
            layer.head_dim,
            layer.input_layernorm.eps,
            self.scale,
            layer.window or 0,
        )
        return out, residual

    def _gather(self) -> tuple[list[torch.Tensor], str]:
        """The op's weight list and GEMM names, gathered once, at the first call: after the
        load has chosen each layer's GEMM and packed its panels (gathering them at every
        call cost about 20 us a layer, some 3% of a batch-1 step)."""
        layer = self.layer
        weights = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
        linears = (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
        for m in linears:
            bias = _NONE if m.bias is None else m.bias
            panels = _NONE if m.panels is None else m.panels
            weights += [m.inv_smooth, m.weight_t, m.weight_scale, m.weight_sums, bias, panels]
        self._weights = weights, ",".join(m.gemm for m in linears)
        return self._weights
