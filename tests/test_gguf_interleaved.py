"""Weights interleaved at load (csrc/gguf_interleaved_layout.h, kernels/gguf_blocks.py
`interleave`): the layout against a reference spelled here from ggml's block structs, the
products on it against the file's rows bit for bit (1-300 input rows, both builds, both
sides of the in-place threshold), and `GGUFLinear.load` taking it where it applies."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from pagedllm.kernels.cpu import load_cpu_ops, missing_cpu_features
from pagedllm.kernels.gguf_blocks import INTERLEAVED_TYPES, block_geometry, interleave
from pagedllm.kernels.policy import GGUF_INTERLEAVED_IN_PLACE_MAX_ROWS
from pagedllm.model.gguf_linear import GGUFLinear, GGUFWeight
from test_gguf_kernels import KERNELS, run, skip_unless_runs, weight_blocks

pytestmark = pytest.mark.skipif(bool(missing_cpu_features()), reason="no compiled kernels here")

# Each block's fields as (first byte, unit bytes, units), in the order the layout puts
# them: Q4_0 d, qs; Q4_1 d, m, qs; Q4_K d, dmin, scales, qs.
FIELDS = {
    T.Q4_0: ((0, 2, 1), (2, 4, 4)),
    T.Q4_1: ((0, 2, 1), (2, 2, 1), (4, 4, 4)),
    T.Q4_K: ((0, 2, 1), (2, 2, 1), (4, 4, 3), (16, 4, 32)),
}


def interleaved_reference(raw: np.ndarray, ggml_type: T) -> np.ndarray:
    """[rows / 16, 16, bytes per row]: per group of 16 rows and block, each field's unit u
    of row i at (u * 16 + i) * unit."""
    rows = raw.shape[0]
    size = block_geometry(ggml_type)[1]
    blocks = raw.reshape(rows // 16, 16, -1, size)  # group, row, block, byte
    fields = []
    for first, unit, count in FIELDS[ggml_type]:
        f = blocks[..., first : first + unit * count].reshape(rows // 16, 16, -1, count, unit)
        fields.append(f.transpose(0, 2, 3, 1, 4).reshape(rows // 16, f.shape[2], -1))
    return np.concatenate(fields, axis=-1).reshape(rows // 16, 16, -1)


@pytest.mark.parametrize("ggml_type", INTERLEAVED_TYPES, ids=lambda t: t.name)
def test_layout_and_its_inverse(ggml_type: T) -> None:
    raw = weight_blocks(ggml_type, 48, 3 * block_geometry(ggml_type)[0], seed=2)
    got = interleave(torch.from_numpy(raw), ggml_type)
    assert got.shape == (3, 16, raw.shape[1])
    np.testing.assert_array_equal(got.numpy(), interleaved_reference(raw, ggml_type))
    assert torch.equal(interleave(got, ggml_type, inverse=True), torch.from_numpy(raw))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("ggml_type", INTERLEAVED_TYPES, ids=lambda t: t.name)
def test_products_equal_the_file_rows_bit_for_bit(ggml_type: T, kernel: str) -> None:
    """Every row count from 1 to 9 (read in place up to the threshold, unpacked per pass
    above it), 23 and 300, on two groups of rows: the one-row method's bits on the file's
    rows."""
    skip_unless_runs(kernel)
    k = 2 * block_geometry(ggml_type)[0]
    raw = weight_blocks(ggml_type, 32, k, seed=7)
    grouped = interleave(torch.from_numpy(raw), ggml_type)
    x = np.random.default_rng(8).standard_normal((300, k)).astype(np.float32)
    assert 1 <= GGUF_INTERLEAVED_IN_PLACE_MAX_ROWS < 9
    for rows in (*range(1, 10), 23, 300):
        got = load_cpu_ops().gguf_linear_parts(
            torch.from_numpy(x[:rows]), [grouped], [int(ggml_type)], kernel
        )
        assert np.array_equal(got.numpy(), run(ggml_type, raw, x[:rows], kernel, "gemv"))


def test_refuses_what_the_layout_cannot_hold() -> None:
    ops = load_cpu_ops()
    with pytest.raises(ValueError, match="in groups of 16; got 8"):
        interleave(torch.zeros(8, 20, dtype=torch.uint8), T.Q4_1)
    with pytest.raises(ValueError, match="GGML type 14 has no interleaved layout"):
        interleave(torch.zeros(16, 210, dtype=torch.uint8), T.Q6_K)
    x = torch.zeros(1, 32)
    with pytest.raises(ValueError, match="Q4_0, Q4_1 or Q4_K only, not Q8_0"):
        ops.gguf_linear_parts(x, [torch.zeros(1, 16, 34, dtype=torch.uint8)], [int(T.Q8_0)])
    grouped = torch.zeros(1, 16, 20, dtype=torch.uint8)
    with pytest.raises(ValueError, match="every part's rows in groups of 16; a part has 3"):
        ops.gguf_linear_parts(
            x, [grouped, torch.zeros(3, 20, dtype=torch.uint8)], [int(T.Q4_1)] * 2
        )


def test_releasing_the_source_keeps_its_contents() -> None:
    """The source's pages are handed back with advice that never changes memory: a tensor
    of the process's own (not a file's) reads the same afterwards."""
    raw = torch.from_numpy(weight_blocks(T.Q4_K, 4096, 256, seed=3))  # 576 KiB
    before = raw.clone()
    interleave(raw, T.Q4_K, release_source=True)
    assert torch.equal(raw, before)


def part(ggml_type: T, rows: int, k: int, seed: int) -> GGUFWeight:
    return GGUFWeight(torch.from_numpy(weight_blocks(ggml_type, rows, k, seed)), ggml_type, k)


def test_linear_layer_interleaves_its_parts_where_they_allow() -> None:
    """A q/k/v of Q4_K, Q4_K and Q6_K in whole groups: the Q4_K parts are interleaved, Q6_K
    stays as stored, and the product is the file rows' bit for bit; with a part of 8
    rows, nothing is (the op splits such a layer over its threads in whole groups)."""
    k = 512
    parts = [part(T.Q4_K, 32, k, 1), part(T.Q4_K, 16, k, 2), part(T.Q6_K, 16, k, 3)]
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(0))
    layer = GGUFLinear(k, 64, kernels=load_cpu_ops())
    layer.load(parts)
    assert [p.interleaved for p in layer.parts] == [True, True, False]
    assert [p.shape for p in layer.parts] == [p.shape for p in parts]
    expected = load_cpu_ops().gguf_linear_parts(
        x, [p.blocks for p in parts], [int(p.ggml_type) for p in parts], "auto", "gemv"
    )
    assert torch.equal(layer(x), expected)
    torch.testing.assert_close(layer.parts[0].dequantize(), parts[0].dequantize(), rtol=0, atol=0)

    uneven = GGUFLinear(k, 40, kernels=load_cpu_ops())
    uneven.load([part(T.Q4_K, 32, k, 1), part(T.Q4_K, 8, k, 2)])
    assert not any(p.interleaved for p in uneven.parts)


def test_two_layers_over_one_weight_share_its_interleaved_copy() -> None:
    """A draft that is the target's own file loads the same weights again: one copy."""
    weights = [part(T.Q4_1, 32, 64, 4)]
    first, second = (
        GGUFLinear(64, 32, kernels=load_cpu_ops()),
        GGUFLinear(64, 32, kernels=load_cpu_ops()),
    )
    first.load(weights)
    second.load(weights)
    assert first.parts[0].interleaved and first.parts[0] is second.parts[0]
