"""Choosing the attention backend, once, at start.

`auto` takes the fastest backend that can serve the configuration: the compiled kernel
on a CPU, the Triton kernels on a CUDA device, and the pure-torch reference when neither
can run here (one warning line saying why). A backend asked for by name that cannot
serve the configuration (device, head size, a failed build) is an error naming the
option.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.reference import ReferenceAttention
from pagedllm.errors import InvalidParameterError, KernelUnavailableError

logger = logging.getLogger("pagedllm")


class AttentionBackend(Protocol):
    """`prepare` builds, once per step, the backend's own plan from the common metadata
    (its work list, tiles or padded groups: whatever it alone needs); every layer's call
    then reads that plan. A plan is opaque to everything but its backend. A layer with an
    attention window passes it with its call (`window` tokens: a query at position p sees
    the keys at (p - window, p]; None: all keys up to p)."""

    name: str

    def prepare(self, meta: AttentionMetadata) -> Any: ...

    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: Any,
        window: int | None = None,
    ) -> torch.Tensor: ...


def _cpu(
    heads: int, kv_heads: int, head_dim: int, device: torch.device, scale: float
) -> AttentionBackend:
    """The compiled CPU kernel; raises ValueError or KernelUnavailableError with the reason."""
    from pagedllm.attention.cpu import CpuPagedAttention
    from pagedllm.kernels.cpu import load_cpu_ops

    if device.type != "cpu":
        raise ValueError(f"it runs on the CPU, not on {device}")
    if head_dim % 8:
        raise ValueError(f"it needs head_dim to be a multiple of 8 (this model's is {head_dim})")
    ops = load_cpu_ops()
    return CpuPagedAttention(kv_heads, scale, ops.paged_attention)


def _triton(
    heads: int, kv_heads: int, head_dim: int, device: torch.device, scale: float
) -> AttentionBackend:
    """The Triton kernels: on a CUDA device, or on the CPU under Triton's interpreter."""
    from pagedllm.attention.triton_backend import INTERPRETED, TritonPagedAttention

    if device.type != "cuda" and not INTERPRETED:
        raise ValueError(f"it needs a CUDA device (or TRITON_INTERPRET=1), not {device}")

    return TritonPagedAttention(heads, kv_heads, head_dim, scale, device)


def select_attention(
    name: str,
    heads: int,
    kv_heads: int,
    head_dim: int,
    device: torch.device,
    scale: float | None = None,
) -> AttentionBackend:
    """The backend `name` (auto, reference, cpu or triton) for this model and device;
    `scale` multiplies q.k (default head_dim ** -0.5; ModelConfig.attention_scale)."""
    scale = head_dim**-0.5 if scale is None else scale
    reference = ReferenceAttention(scale)
    if name == "reference":
        return reference
    builders = {"cpu": _cpu, "triton": _triton}
    if name == "auto":
        choice = "triton" if device.type == "cuda" else "cpu"
        try:
            return builders[choice](heads, kv_heads, head_dim, device, scale)
        except (ValueError, KernelUnavailableError, ImportError) as exc:  # not here
            logger.warning(
                "attention backend: the %s kernel cannot run here (%s); using the reference",
                choice,
                exc,
            )
            return reference
    try:
        return builders[name](heads, kv_heads, head_dim, device, scale)
    except (ValueError, KernelUnavailableError, ImportError) as exc:
        raise InvalidParameterError(
            "attention_backend", f"attention_backend={name!r} cannot serve this model: {exc}"
        ) from exc
