"""The compiled row dequantization (csrc/gguf_dequantize.cpp) that looks up embedding rows
in a table kept as GGUF blocks: for every type the kernels take, the rows asked for (in any
order, repeated) equal gguf-py's dequantization, the loader's, number for number."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from ggml_blocks import random_blocks
from pagedllm.kernels.cpu import load_cpu_ops, missing_cpu_features
from pagedllm.kernels.gguf_blocks import KERNEL_TYPES, block_geometry

pytestmark = pytest.mark.skipif(bool(missing_cpu_features()), reason="no compiled kernels here")


def table(ggml_type: T, rows: int, cols: int) -> np.ndarray:
    """uint8 [rows, bytes per row] of random `ggml_type` blocks with finite scales."""
    rng = np.random.default_rng(int(ggml_type))
    if ggml_type in (T.F16, T.BF16):
        values = rng.standard_normal((rows, cols)).astype(np.float32)
        if ggml_type == T.F16:
            return values.astype(np.float16).view(np.uint8)
        return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    if ggml_type == T.Q4_1:  # d and m, the block's two f16 fields, then its nibbles
        values, size = block_geometry(ggml_type)
        raw = rng.integers(0, 256, (rows, cols // values, size), dtype=np.uint8)
        scales = rng.uniform(-0.02, 0.02, (rows, cols // values, 2)).astype(np.float16)
        raw[:, :, :4] = scales.view(np.uint8)
        return raw.reshape(rows, -1)
    return random_blocks(ggml_type.name, rows, cols, seed=int(ggml_type))


@pytest.mark.parametrize("ggml_type", KERNEL_TYPES, ids=lambda t: t.name)
def test_rows_equal_gguf_py(ggml_type: T) -> None:
    blocks = table(ggml_type, 37, 512)
    rows = torch.tensor([5, 0, 36, 5, 17], dtype=torch.long)
    got = load_cpu_ops().gguf_dequantize_rows(torch.from_numpy(blocks), rows, int(ggml_type))
    want = torch.from_numpy(dequantize(blocks[rows.numpy()], ggml_type).astype(np.float32))
    assert got.shape == (5, 512)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_refuses_rows_out_of_range_and_other_types() -> None:
    ops = load_cpu_ops()
    blocks = torch.from_numpy(table(T.Q8_0, 4, 64))
    with pytest.raises(IndexError, match="row 4 is out of range for a table of 4 rows"):
        ops.gguf_dequantize_rows(blocks, torch.tensor([0, 4]), int(T.Q8_0))
    with pytest.raises(ValueError, match="GGML type 0 has no dequantization here"):
        ops.gguf_dequantize_rows(blocks, torch.tensor([0]), 0)
    with pytest.raises(ValueError, match="rows must be a 1-D int64 tensor"):
        ops.gguf_dequantize_rows(blocks, torch.tensor([0], dtype=torch.int32), int(T.Q8_0))
