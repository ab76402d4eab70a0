"""The GGUF block kernels (kernels/gguf_blocks.py, csrc/gguf_linear.cpp) against references
written here, for every type, on the AVX2 and (where the CPU has it) the AVX-512 VNNI build.

The references follow ggml's definitions, not its code. Activations are quantized per block
as ggml's x86 build does: Q8_0/Q8_1 x * (127 / max|x|) rounded half to even, d = fp16(max|x|
/ 127) (ggml's scalar quantize_row_q8_0_ref multiplies by 1 / d and rounds half away from
zero instead), our Q8_1 keeping the integer sum of its quants; Q8_K as quantize_row_q8_K_ref,
x * (-127 / the value of largest magnitude) rounded half to even, capped at 127, d = 1 / that
factor in fp32. The weight blocks are decoded here into integer quants with per-sub-block
scale and offset (w = scale * q + offset), and a product is the integer sums per sub-block
times the scales. Checked: the activation blocks bit for bit; the integer parts bit for bit
(scales that are powers of two make every float step exact, so the output must equal the
reference exactly); and with ordinary scales, the output against the same sums and against
gguf-py's dequantized weights times the dequantized activations, in float64, within 1e-5 of
the sum of the products' magnitudes (fp32 rounding). The types with a multi-row "gemm"
method are checked the same way on it, for 1-300 rows, and its outputs equal the one-row
"gemv" method's bit for bit.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from ggml_blocks import random_blocks
from pagedllm.kernels.cpu import load_cpu_ops, missing_cpu_features
from pagedllm.kernels.gguf_blocks import (
    GEMM_TYPES,
    KERNEL_TYPES,
    block_geometry,
    gguf_linear,
    kernel_build,
    quantize_activations,
)

pytestmark = pytest.mark.skipif(bool(missing_cpu_features()), reason="no compiled kernels here")

QUANT_TYPES = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K)
ACTIVATION = {T.Q4_0: "Q8_1", T.Q4_1: "Q8_1", T.Q5_0: "Q8_0", T.Q8_0: "Q8_0"}
# (rows, input blocks, output features): no output count a multiple of a tile.
SHAPES = ((1, 1, 1), (2, 3, 7), (5, 17, 13), (9, 2, 41))
# The gemm method's: row counts around its groups of 4, up to 300; (6, 8, 1000) crosses
# its tiles of weight rows (128 KiB) in every type.
GEMM_SHAPES = ((1, 2, 3), (3, 1, 5), (4, 2, 9), (7, 3, 11), (13, 2, 6), (300, 3, 7), (6, 8, 1000))
KERNELS = ("avx2", "vnni")
# (ggml_type, rows, blocks, out, method): each type's one-row kernels on SHAPES, and the
# gemm method on GEMM_SHAPES where the type has it.
CASES = [
    pytest.param(t, rows, blocks, out, method, id=f"{t.name}-{method}-{rows}x{blocks}x{out}")
    for types, shapes, method in ((QUANT_TYPES, SHAPES, "gemv"), (GEMM_TYPES, GEMM_SHAPES, "gemm"))
    for t in types
    for rows, blocks, out in shapes
]


def skip_unless_runs(kernel: str) -> None:
    if kernel == "vnni" and not load_cpu_ops().int8_has_vnni()[0]:
        pytest.skip("this CPU has no AVX-512 VNNI")


# --- activations ----------------------------------------------------------------------


def activation_kind(ggml_type: T) -> str:
    return ACTIVATION.get(ggml_type, "Q8_K")


def quantize_reference(x: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(quants int64 [rows, k], d float64 [rows, k / block], the blocks' bytes) of fp32 x."""
    rows, k = x.shape
    block = 256 if kind == "Q8_K" else 32
    v = x.reshape(rows, k // block, block).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        if kind == "Q8_K":
            first = np.abs(v).argmax(axis=-1)[..., None]  # the first of largest magnitude
            peak = np.take_along_axis(v, first, axis=-1)
            iscale = np.where(peak != 0, np.float32(-127) / peak, np.float32(0))
            q = np.minimum(np.rint(v * iscale), 127)
            d = np.where(peak != 0, np.float32(1) / iscale, np.float32(0))[..., 0]
            d_stored = d.astype(np.float32)
        else:
            amax = np.abs(v).max(axis=-1, keepdims=True)
            inv = np.where(amax != 0, np.float32(127) / amax, np.float32(0))
            q = np.rint(v * inv)
            d_stored = (amax[..., 0] / np.float32(127)).astype(np.float16)
    q = q.astype(np.int64)
    fields: list[tuple[str, str] | tuple[str, str, tuple[int, ...]]]
    if kind == "Q8_K":
        fields = [("d", "<f4"), ("qs", "i1", (256,)), ("bsums", "<i2", (16,))]
    elif kind == "Q8_1":
        fields = [("d", "<f2"), ("sum", "<i2"), ("qs", "i1", (32,))]
    else:
        fields = [("d", "<f2"), ("qs", "i1", (32,))]
    blocks = np.zeros((rows, k // block), dtype=np.dtype(fields))
    blocks["d"] = d_stored
    blocks["qs"] = q
    if kind == "Q8_1":
        blocks["sum"] = q.sum(axis=-1)
    if kind == "Q8_K":
        blocks["bsums"] = q.reshape(rows, k // block, 16, 16).sum(axis=-1)
    raw = blocks.view(np.uint8).reshape(rows, -1)
    return q.reshape(rows, k), d_stored.astype(np.float64), raw


# --- weights ----------------------------------------------------------------------------


def scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's get_scale_min_k4 for the 8 sub-blocks: 6-bit scales and mins [blocks, 8]."""
    s = scales.astype(np.int64)
    low_sc, low_m = s[:, 0:4] & 63, s[:, 4:8] & 63
    high_sc = (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)
    high_m = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return np.concatenate([low_sc, high_sc], 1), np.concatenate([low_m, high_m], 1)


def integer_form(ggml_type: T, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Weight rows as (quants int64 [out, k], scale and offset float64 [out, k / sub], sub):
    value = scale * quant + offset in each sub-block of `sub` values."""
    values, size = block_geometry(ggml_type)
    out = raw.shape[0]
    b = raw.reshape(-1, size)

    def f16(at: int) -> np.ndarray:
        return b[:, at : at + 2].copy().view(np.float16)[:, 0].astype(np.float64)

    def nibbles(qs: np.ndarray) -> np.ndarray:  # 16 bytes -> 32 values: low nibbles first
        return np.concatenate([qs & 0xF, qs >> 4], axis=-1).astype(np.int64)

    zero = np.zeros(len(b))
    if ggml_type in (T.Q4_0, T.Q4_1):
        q, scale = nibbles(b[:, -16:]), f16(0)[:, None]
        offset = f16(2)[:, None] if ggml_type == T.Q4_1 else zero[:, None]
        q = q - 8 if ggml_type == T.Q4_0 else q
        sub = 32
    elif ggml_type == T.Q5_0:
        high = np.unpackbits(b[:, 2:6], axis=1, bitorder="little").astype(np.int64)
        q, scale, offset, sub = (
            (nibbles(b[:, 6:22]) | high << 4) - 16,
            f16(0)[:, None],
            zero[:, None],
            32,
        )
    elif ggml_type == T.Q8_0:
        q, scale, offset, sub = (
            b[:, 2:].view(np.int8).astype(np.int64),
            f16(0)[:, None],
            zero[:, None],
            32,
        )
    elif ggml_type in (T.Q4_K, T.Q5_K):
        sc, m = scale_min_k4(b[:, 4:16])
        scale, offset, sub = f16(0)[:, None] * sc, -f16(2)[:, None] * m, 32
        qs = b[:, -128:].reshape(-1, 4, 32)  # 4 chunks of 64 values: low nibbles, then high
        q = np.stack([qs & 0xF, qs >> 4], axis=2).astype(np.int64)
        if ggml_type == T.Q5_K:
            qh = b[:, 16:48].astype(np.int64)
            bits = np.stack([(qh >> bit) & 1 for bit in range(8)], axis=1)  # [blocks, 8, 32]
            q = q | bits.reshape(-1, 4, 2, 32) << 4
        q = q.reshape(-1, 256)
    elif ggml_type == T.Q6_K:
        ql, qh = b[:, 0:128].reshape(-1, 2, 64), b[:, 128:192].reshape(-1, 2, 32)
        lo, hi = ql & 0xF, ql >> 4
        parts = [lo[..., :32], lo[..., 32:], hi[..., :32], hi[..., 32:]]
        q = np.stack([p | ((qh >> (2 * g)) & 3) << 4 for g, p in enumerate(parts)], axis=2)
        q = q.astype(np.int64).reshape(-1, 256) - 32
        scale = f16(208)[:, None] * b[:, 192:208].view(np.int8).astype(np.float64)
        offset, sub = np.zeros_like(scale), 16
    else:
        raise AssertionError(ggml_type)
    per_block = values // sub
    return (
        q.reshape(out, -1),
        np.broadcast_to(scale, (len(b), per_block)).reshape(out, -1),
        np.broadcast_to(offset, (len(b), per_block)).reshape(out, -1),
        sub,
    )


def weight_blocks(ggml_type: T, out: int, k: int, seed: int) -> np.ndarray:
    """uint8 [out, bytes]: gguf-py's quantization of random values where it has one (the
    32-value types), else random valid blocks (random quants, fp16 scales and mins)."""
    if ggml_type in ACTIVATION:
        rng = np.random.default_rng(seed)
        return quantize(rng.standard_normal((out, k)).astype(np.float32), ggml_type)
    return random_blocks(ggml_type.name, out, k, seed=seed)


def reference(ggml_type: T, raw: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, ...]:
    """(the integer-sum product, gguf-py's dequantized product, the sum of the products'
    magnitudes, the activation blocks' bytes), float64 [rows, out] but the last."""
    kind = activation_kind(ggml_type)
    qa, da, act_raw = quantize_reference(x, kind)
    qw, scale, offset, sub = integer_form(ggml_type, raw)
    rows, k = qa.shape
    a_sub = qa.reshape(rows, -1, sub)
    d_sub = np.repeat(da, qa.shape[1] // da.shape[1] // sub, axis=1)  # [rows, k / sub]
    sums = np.einsum("rsi,osi->ros", a_sub, qw.reshape(len(qw), -1, sub))  # int64, exact
    block_sums = scale[None] * sums + offset[None] * a_sub.sum(-1)[:, None, :]
    by_sums = (d_sub[:, None, :] * block_sums).sum(-1)
    a_deq = np.repeat(d_sub, sub, axis=1) * qa
    w_deq = dequantize(raw, ggml_type).astype(np.float64).reshape(len(raw), k)
    np.testing.assert_allclose(  # our decoding of the blocks agrees with gguf-py's
        np.repeat(scale, sub, 1) * qw + np.repeat(offset, sub, 1), w_deq, rtol=1e-6, atol=1e-9
    )
    return by_sums, a_deq @ w_deq.T, np.abs(a_deq) @ np.abs(w_deq).T, act_raw


def run(
    ggml_type: T, raw: np.ndarray, x: np.ndarray, kernel: str, method: str = "auto"
) -> np.ndarray:
    out = gguf_linear(
        torch.from_numpy(x), torch.from_numpy(raw), ggml_type, raw.shape[0], kernel, method
    )
    assert out.dtype == torch.float32 and out.shape == (x.shape[0], raw.shape[0])
    return out.numpy().astype(np.float64)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize(("ggml_type", "rows", "blocks", "out", "method"), CASES)
def test_layer_equals_dequantized_product(
    ggml_type: T, rows: int, blocks: int, out: int, method: str, kernel: str
) -> None:
    """Ordinary scales: the activation blocks bit for bit; the output equals the integer
    sums times the scales, and gguf-py's dequantized weights times the dequantized
    activations, in float64 within 1e-5 of the sum of the products' magnitudes."""
    skip_unless_runs(kernel)
    k = blocks * block_geometry(ggml_type)[0]
    raw = weight_blocks(ggml_type, out, k, seed=rows * 100 + out)
    x = np.random.default_rng(out).standard_normal((rows, k)).astype(np.float32)
    x[0, : k // 3] = 0.0  # zero blocks (d = 0) too
    by_sums, dequantized, magnitude, act_raw = reference(ggml_type, raw, x)
    got = quantize_activations(torch.from_numpy(x), ggml_type, kernel).numpy()
    np.testing.assert_array_equal(got, act_raw)
    y = run(ggml_type, raw, x, kernel, method)
    assert np.all(np.abs(y - by_sums) <= 1e-5 * magnitude + 1e-30)
    assert np.all(np.abs(y - dequantized) <= 1e-5 * magnitude + 1e-30)


@pytest.mark.parametrize("ggml_type", (*QUANT_TYPES, T.F16), ids=lambda t: t.name)
def test_wide_rows(ggml_type: T) -> None:
    """Rows as wide as a 7B model's FFN down projection (18944 inputs, activation blocks
    larger than the L1 cache): the product within 1e-5 of the sum of its magnitudes, and
    the one-row method the gemm method's bits."""
    k, out = 18944, 6
    x = np.random.default_rng(5).standard_normal((3, k)).astype(np.float32)
    if ggml_type == T.F16:
        w = np.random.default_rng(6).standard_normal((out, k)).astype(np.float16)
        expected, magnitude = x @ w.astype(np.float64).T, np.abs(x) @ np.abs(w.astype(np.float64)).T
        raw = w.view(np.uint8)
    else:
        raw = weight_blocks(ggml_type, out, k, seed=7)
        _, expected, magnitude, _ = reference(ggml_type, raw, x)
    has_vnni = load_cpu_ops().int8_has_vnni()[0]
    for kernel in KERNELS if has_vnni else ("avx2",):
        y = run(ggml_type, raw, x, kernel)
        assert np.all(np.abs(y - expected) <= 1e-5 * magnitude + 1e-30)
        if ggml_type in GEMM_TYPES:
            gemv = run(ggml_type, raw, x, kernel, "gemv")
            assert np.array_equal(run(ggml_type, raw, x, kernel, "gemm"), gemv)


def exact_scales(ggml_type: T, raw: np.ndarray) -> np.ndarray:
    """The blocks with every fp16 scale and min a power of two."""
    _, size = block_geometry(ggml_type)
    b = raw.reshape(-1, size).copy()
    fields = {
        T.Q4_1: {0: 0.125, 2: -0.25},
        T.Q4_K: {0: 0.125, 2: 0.0625},
        T.Q5_K: {0: 0.125, 2: 0.0625},
    }
    for at, value in fields.get(ggml_type, {208 if ggml_type == T.Q6_K else 0: 0.125}).items():
        b[:, at : at + 2] = np.full((len(b), 1), value, np.float16).view(np.uint8)
    return b.reshape(raw.shape)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize(("ggml_type", "rows", "blocks", "out", "method"), CASES)
def test_integer_sums_bit_for_bit(
    ggml_type: T, rows: int, blocks: int, out: int, method: str, kernel: str
) -> None:
    """Scales that are powers of two and activations that are small multiples of 1/64 with
    one +-127/64 per block: every float step of the kernel is exact, so its output equals
    the integer sums times the scales exactly."""
    skip_unless_runs(kernel)
    values = block_geometry(ggml_type)[0]
    k = blocks * values
    raw = exact_scales(ggml_type, weight_blocks(ggml_type, out, k, seed=rows + out))
    rng = np.random.default_rng(rows * out)
    ints = rng.integers(-2, 3, (rows, k))
    act_block = 256 if activation_kind(ggml_type) == "Q8_K" else 32
    ints[:, ::act_block] = rng.choice([-127, 127], (rows, k // act_block))
    x = (ints / 64).astype(np.float32)
    by_sums, *_ = reference(ggml_type, raw, x)
    assert np.array_equal(run(ggml_type, raw, x, kernel, method), by_sums.astype(np.float32))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("ggml_type", GEMM_TYPES, ids=lambda t: t.name)
def test_gemm_equals_gemv_bit_for_bit(ggml_type: T, kernel: str) -> None:
    """Every row count from 1 to 23 (each tail of the groups of 4) and 300: the gemm
    method's outputs are the one-row kernels' bits."""
    skip_unless_runs(kernel)
    k = 2 * block_geometry(ggml_type)[0]
    raw = weight_blocks(ggml_type, 19, k, seed=11)
    x = np.random.default_rng(12).standard_normal((300, k)).astype(np.float32)
    for rows in (*range(1, 24), 300):
        gemv = run(ggml_type, raw, x[:rows], kernel, "gemv")
        assert np.array_equal(run(ggml_type, raw, x[:rows], kernel, "gemm"), gemv)


@pytest.mark.parametrize("method", ("gemv", "gemm"))
def test_parts_of_mixed_types(method: str) -> None:
    """A fused layer whose parts mix types with and without a gemm method (Q4_K, Q5_K,
    F16, Q6_K): each part's columns equal that part alone, on either method."""
    k, rows = 512, 11
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(4))
    parts = [(T.Q4_K, 5), (T.Q5_K, 3), (T.F16, 4), (T.Q6_K, 7)]
    f16 = torch.randn(4, k, generator=torch.Generator().manual_seed(5)).half()
    raws = [
        f16.view(torch.uint8) if t == T.F16 else torch.from_numpy(weight_blocks(t, out, k, out))
        for t, out in parts
    ]
    got = load_cpu_ops().gguf_linear_parts(x, raws, [int(t) for t, _ in parts], "auto", method)
    alone = [gguf_linear(x, raws[i], t, out, "auto", "gemv") for i, (t, out) in enumerate(parts)]
    assert torch.equal(got, torch.cat(alone, dim=1))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("ggml_type", (T.F16, T.BF16), ids=lambda t: t.name)
@pytest.mark.parametrize(("rows", "k", "out"), ((1, 8, 1), (3, 37, 7), (9, 300, 41)))
def test_half_precision_weights(ggml_type: T, rows: int, k: int, out: int, kernel: str) -> None:
    """F16 and BF16 weights multiply the fp32 inputs as they are (any width)."""
    skip_unless_runs(kernel)
    gen = torch.Generator().manual_seed(k)
    w = torch.randn(out, k, generator=gen)
    half = w.to(torch.float16 if ggml_type == T.F16 else torch.bfloat16)
    raw = half.view(torch.uint8).numpy()
    x = torch.randn(rows, k, generator=gen).numpy()
    w64 = half.to(torch.float64).numpy()
    y = run(ggml_type, raw, x, kernel)
    expected, magnitude = x.astype(np.float64) @ w64.T, np.abs(x) @ np.abs(w64).T
    assert np.all(np.abs(y - expected) <= 1e-5 * magnitude + 1e-30)


def test_vnni_and_avx2_agree_bit_for_bit() -> None:
    """The two builds differ only in how the exact int8 sums are formed: same outputs."""
    skip_unless_runs("vnni")
    x = np.random.default_rng(1).standard_normal((3, 512)).astype(np.float32)
    for ggml_type in QUANT_TYPES:
        raw = weight_blocks(ggml_type, 13, 512, seed=3)
        assert np.array_equal(run(ggml_type, raw, x, "avx2"), run(ggml_type, raw, x, "vnni"))


def test_auto_is_vnni_where_the_cpu_has_it() -> None:
    has_vnni, used = load_cpu_ops().int8_has_vnni()
    assert kernel_build("avx2") == "avx2"
    assert kernel_build("auto") == ("vnni" if used else "avx2")
    assert used == (has_vnni and "PAGEDLLM_NO_VNNI" not in os.environ)


def test_no_vnni_takes_the_avx2_build() -> None:
    """PAGEDLLM_NO_VNNI=1 (read once per process: a subprocess): "auto" is the AVX2 build."""
    code = """
from pagedllm.kernels.gguf_blocks import kernel_build
print(kernel_build("auto"))
"""
    env = {**os.environ, "PAGEDLLM_NO_VNNI": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "avx2"


@pytest.mark.parametrize(
    ("ggml_type", "k", "out", "weight_bytes", "message"),
    [
        (T.Q4_K, 128, 2, 144, "input width 128 is not a multiple of Q4_K's block of 256"),
        (T.Q6_K, 768, 1, 629, "the weight has 629 bytes; 1 rows of 768 Q6_K values take 630"),
        (T.Q4_0, 48, 1, 18, "input width 48 is not a multiple of Q4_0's block of 32"),
        (T.Q8_0, 64, 3, 3 * 68 - 1, "the weight has 203 bytes; 3 rows of 64 Q8_0 values take 204"),
        (T.Q2_K, 256, 1, 84, "GGML type 10 has no kernel here"),
    ],
)
def test_refuses_what_it_cannot_compute(
    ggml_type: T, k: int, out: int, weight_bytes: int, message: str
) -> None:
    x = torch.zeros(2, k)
    w = torch.zeros(weight_bytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        gguf_linear(x, w, ggml_type, out)


def test_refuses_bad_inputs_and_kernels() -> None:
    w = torch.zeros(1, 34, dtype=torch.uint8)
    with pytest.raises(ValueError, match="x must be a float32"):
        gguf_linear(torch.zeros(1, 32, dtype=torch.float64), w, T.Q8_0, 1)
    with pytest.raises(ValueError, match="the weight must be a contiguous uint8"):
        gguf_linear(torch.zeros(1, 32), w.to(torch.int8), T.Q8_0, 1)
    with pytest.raises(ValueError, match="kernel must be 'auto', 'avx2' or 'vnni', not 'sse'"):
        gguf_linear(torch.zeros(1, 32), w, T.Q8_0, 1, "sse")
    with pytest.raises(ValueError, match="method must be 'auto', 'gemv' or 'gemm', not 'gemmm'"):
        gguf_linear(torch.zeros(1, 32), w, T.Q8_0, 1, "auto", "gemmm")


def test_kernel_types_are_what_the_op_takes() -> None:
    """KERNEL_TYPES lists exactly the types the op computes on."""
    for ggml_type in T:
        values, size = block_geometry(ggml_type)
        x, w = torch.zeros(1, 256 * values), torch.zeros(256 * size, dtype=torch.uint8)
        if ggml_type in KERNEL_TYPES:
            assert gguf_linear(x, w, ggml_type, 1).tolist() == [[0.0]]
        else:
            with pytest.raises(ValueError, match=f"GGML type {int(ggml_type)} has no kernel"):
                gguf_linear(x, w, ggml_type, 1)
