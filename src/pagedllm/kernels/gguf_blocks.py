"""Linear layers on GGUF weights as stored: the GGML types the compiled kernels compute on,
their block geometry, and the call of the `gguf_linear` op (csrc/gguf_linear.cpp).

A weight of such a type is a uint8 tensor of its raw blocks, one row of
`in_features / values_per_block` blocks per output feature, exactly as the file holds it;
or, for INTERLEAVED_TYPES, the same bytes rearranged in groups of 16 rows
([rows / 16, 16, bytes per row], `interleave`), which the kernels read without unpacking
the rows per call.
"""

from __future__ import annotations

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from pagedllm.kernels.cpu import load_cpu_ops

# The types `gguf_linear` computes on (what the Q4_K_M/Q5_K_M mixes, Q8_0, Q4_0, Q4_1 and
# Q5_0 files hold, and unquantized F16/BF16 tensors).
KERNEL_TYPES: tuple[GGMLQuantizationType, ...] = (
    GGMLQuantizationType.F16,
    GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q5_K,
    GGMLQuantizationType.Q6_K,
)

# The types with a "gemm" method (a multi-row kernel) in `gguf_linear`: every block type
# (F16 and BF16 have none).
GEMM_TYPES: tuple[GGMLQuantizationType, ...] = (
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q5_K,
    GGMLQuantizationType.Q6_K,
)


# The types whose weights are interleaved at load (csrc/gguf_interleaved_layout.h), in
# groups of this many rows (docs/kernels.md says why Q6_K is not).
INTERLEAVED_TYPES: tuple[GGMLQuantizationType, ...] = (
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q4_K,
)
INTERLEAVED_GROUP_ROWS = 16


def block_geometry(ggml_type: GGMLQuantizationType) -> tuple[int, int]:
    """(values per block, bytes per block) of a GGML type."""
    return GGML_QUANT_SIZES[ggml_type]


def kernel_build(kernel: str = "auto") -> str:
    """The build `kernel` names on this machine: "avx2" or "vnni" ("auto": AVX-512 VNNI
    where the CPU has it and PAGEDLLM_NO_VNNI is unset)."""
    return load_cpu_ops().gguf_kernel(kernel)


def gguf_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    ggml_type: GGMLQuantizationType,
    out_features: int,
    kernel: str = "auto",
    method: str = "auto",
) -> torch.Tensor:
    """x (fp32 [rows, in]) @ W^T for W [out_features, in] stored as `weight`, its raw
    `ggml_type` blocks (uint8). `kernel`: "auto", "avx2" or "vnni" (see kernel_build).
    `method`: "gemv" (each weight block unpacked once per input row), "gemm" (once for
    several rows, where the type has it: GEMM_TYPES) or "auto" (gemm from
    policy.GGUF_GEMM_MIN_ROWS rows on); the outputs are the same bits."""
    return load_cpu_ops().gguf_linear(x, weight, int(ggml_type), out_features, kernel, method)


def quantize_activations(
    x: torch.Tensor, ggml_type: GGMLQuantizationType, kernel: str = "auto"
) -> torch.Tensor:
    """The 8-bit blocks (Q8_0, Q8_1 or Q8_K) `gguf_linear` turns each row of x into before
    multiplying it with `ggml_type` weights, as uint8 [rows, bytes]."""
    return load_cpu_ops().gguf_quantize_activations(x, int(ggml_type), kernel)


def interleave(
    blocks: torch.Tensor,
    ggml_type: GGMLQuantizationType,
    inverse: bool = False,
    release_source: bool = False,
) -> torch.Tensor:
    """`blocks` [rows, bytes per row] (rows a multiple of 16) in the interleaved layout, a
    new [rows / 16, 16, bytes per row] tensor; `inverse`: back to the file's. With
    `release_source`, the source's pages are handed back to the kernel (a tensor read
    through a memory map then stops counting in resident memory)."""
    return load_cpu_ops().gguf_interleave(blocks, int(ggml_type), inverse, release_source)
