"""The element-wise work of a decoder layer behind one small interface, chosen once.

`TorchLayerOps` is the reference: pure torch, any dtype and device, the same numbers the
model always computed. `CompiledLayerOps` runs float32 CPU tensors through the kernels:
the fused element-wise ops (kernels/csrc/fused_ops.cpp: one pass and one dispatch each
where torch takes several) and, for the few rows of a decode step, a matrix-vector
product spread over the threads (dense_linear.cpp); anything else through the reference.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from pagedllm.kernels.policy import GEMV_MAX_ROWS


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class TorchLayerOps:
    name = "torch"

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # In fp32 whatever the model dtype, as transformers does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(x.dtype)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """residual += x (in place); rms_norm(residual)."""
        residual.add_(x)
        return self.rms_norm(residual, weight, eps)

    def rotary(
        self,
        positions: torch.Tensor,
        qkv: torch.Tensor,  # [T, (heads + 2 * kv_heads) * head_dim], q and k rotated in place
        cos: torch.Tensor,  # [max positions, head_dim]
        sin: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
    ) -> None:
        qk = qkv[:, : (num_heads + num_kv_heads) * head_dim].view(qkv.shape[0], -1, head_dim)
        c = cos[positions].unsqueeze(1).to(qkv.dtype)
        s = sin[positions].unsqueeze(1).to(qkv.dtype)
        qk.copy_(qk * c + rotate_half(qk) * s)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """Gemma's gated MLP: gelu(gate) (tanh approximation) * up."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


class CompiledLayerOps(TorchLayerOps):
    name = "compiled"

    def __init__(self, ops: Any) -> None:
        self.ops = ops  # torch.ops.pagedllm_cpu

    @staticmethod
    def _fits(x: torch.Tensor) -> bool:
        return x.dtype == torch.float32 and x.is_cpu and x.stride(-1) == 1

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        # A few rows: a matrix-vector product, bound by reading the weights; the kernel
        # spreads it over the threads. More rows: torch's blocked GEMM is faster.
        rows = x.shape[0] if x.dim() == 2 else 0
        if 1 <= rows <= GEMV_MAX_ROWS and x.shape[1] % 8 == 0 and self._fits(x):
            return self.ops.dense_linear(x.contiguous(), weight, bias)
        return F.linear(x, weight, bias)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if not self._fits(x):
            return super().rms_norm(x, weight, eps)
        return self.ops.rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        if not (self._fits(x) and self._fits(residual)):
            return super().add_rms_norm(x, residual, weight, eps)
        return self.ops.add_rms_norm(x, residual, weight, eps)

    def rotary(
        self,
        positions: torch.Tensor,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
    ) -> None:
        if not self._fits(qkv) or cos.dtype != torch.float32:
            super().rotary(positions, qkv, cos, sin, num_heads, num_kv_heads, head_dim)
            return
        self.ops.rotary(positions, qkv, cos, sin, num_heads, num_kv_heads, head_dim)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if not self._fits(gate_up):
            return super().silu_and_mul(gate_up)
        return self.ops.silu_and_mul(gate_up)
