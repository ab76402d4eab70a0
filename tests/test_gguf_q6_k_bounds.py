"""Q6_K's interleaved panels at the edges of their integer sums: the weights signed (-32 or
31 everywhere) against activations of +-127, with the largest scales of either sign. The
AVX2 build adds 4 such products in 16 bits (at most 4 x 255 x 32 = 32640 with the
activations made unsigned), so these are the blocks that would overflow first; the panels'
outputs must still be the one-row dot's bits, and agree with the integer sums."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from pagedllm.kernels.cpu import missing_cpu_features
from pagedllm.kernels.policy import GGUF_Q6_K_INTERLEAVED_MIN_ROWS
from test_gguf_kernels import KERNELS, reference, run, skip_unless_runs

pytestmark = pytest.mark.skipif(bool(missing_cpu_features()), reason="no compiled kernels here")

BLOCK_BYTES = 210  # ql 128, qh 64, int8 scales 16, fp16 d


def extreme_rows(rows: int, blocks: int) -> np.ndarray:
    """uint8 [rows, blocks * 210]: row i's stored values all 0 (q = -32) or all 63 (q = 31)
    and its scales all -128 or all 127, the four kinds in turn; d = 0.125."""
    b = np.zeros((rows, blocks, BLOCK_BYTES), np.uint8)
    for i in range(rows):
        b[i, :, :192] = 0xFF if i % 2 else 0x00
        b[i, :, 192:208] = 0x7F if i // 2 % 2 else 0x80
    b[:, :, 208:] = np.full((rows, blocks, 1), 0.125, np.float16).view(np.uint8)
    return b.reshape(rows, -1)


@pytest.mark.parametrize("kernel", KERNELS)
def test_largest_sums_are_the_one_row_dots_bits(kernel: str) -> None:
    skip_unless_runs(kernel)
    blocks = 2
    raw = extreme_rows(32, blocks)
    # Per activation block, the first value of largest magnitude sets the sign that
    # quantizes to -127: -127/64 first and 127/64 after make the rest +127 (unsigned 255),
    # and the opposite row makes them -127.
    ints = np.full((23, blocks * 256), 127)
    ints[1::2] *= -1
    ints[:, ::256] *= -1
    x = (ints / 64).astype(np.float32)
    by_sums, *_ = reference(T.Q6_K, raw, x)
    for rows in (GGUF_Q6_K_INTERLEAVED_MIN_ROWS, 8, 23):
        gemm = run(T.Q6_K, raw, x[:rows], kernel, "gemm")
        assert np.array_equal(gemm, run(T.Q6_K, raw, x[:rows], kernel, "gemv"))
        np.testing.assert_allclose(gemm, by_sums[:rows], rtol=1e-6)
