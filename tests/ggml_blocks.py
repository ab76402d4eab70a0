"""Raw ggml quantized blocks for tests, and an independent decoder of each format.

`random_blocks(kind, rows, cols)` returns random bytes laid out as llama.cpp's block structs
(`ggml-common.h`), with every f16 scale set to a small finite value; `decode(kind, raw)`
decodes them the way `ggml-quants.c`'s `dequantize_row_*` does, written out from those C
loops (one block at a time), not from gguf-py's vectorized code that the loader uses.
"""

from __future__ import annotations

import numpy as np

QK_K = 256
# kind -> (values per block, bytes per block)
BLOCKS = {
    "Q4_0": (32, 18),
    "Q5_0": (32, 22),
    "Q8_0": (32, 34),
    "Q4_K": (QK_K, 144),
    "Q5_K": (QK_K, 176),
    "Q6_K": (QK_K, 210),
}
# Byte offsets of each block's f16 scales.
F16_FIELDS = {
    "Q4_0": (0,),
    "Q5_0": (0,),
    "Q8_0": (0,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}


def random_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """uint8 [rows, cols / values_per_block * block_bytes] of random blocks."""
    values, size = BLOCKS[kind]
    assert cols % values == 0
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // values, size), dtype=np.uint8)
    for offset in F16_FIELDS[kind]:
        scale = rng.uniform(0.001, 0.02, (rows, cols // values)).astype(np.float16)
        raw[:, :, offset : offset + 2] = scale.view(np.uint8).reshape(rows, cols // values, 2)
    return raw.reshape(rows, -1)


def _f16(b: np.ndarray, at: int) -> float:
    return float(b[at : at + 2].view(np.float16)[0])


def _scale_min_k4(j: int, q: np.ndarray) -> tuple[int, int]:
    """ggml's get_scale_min_k4: the 6-bit scale and min of sub-block j of 8."""
    if j < 4:
        return int(q[j]) & 63, int(q[j + 4]) & 63
    d = (int(q[j + 4]) & 0xF) | ((int(q[j - 4]) >> 6) << 4)
    m = (int(q[j + 4]) >> 4) | ((int(q[j]) >> 6) << 4)
    return d, m


def _q4_0(b: np.ndarray) -> list[float]:
    d, qs = _f16(b, 0), b[2:18]
    y = [0.0] * 32
    for j in range(16):
        y[j] = ((int(qs[j]) & 0xF) - 8) * d
        y[j + 16] = ((int(qs[j]) >> 4) - 8) * d
    return y


def _q5_0(b: np.ndarray) -> list[float]:
    d, qh, qs = _f16(b, 0), int(b[2:6].view("<u4")[0]), b[6:22]
    y = [0.0] * 32
    for j in range(16):
        xh_0 = ((qh >> j) << 4) & 0x10
        xh_1 = (qh >> (j + 12)) & 0x10
        y[j] = (((int(qs[j]) & 0x0F) | xh_0) - 16) * d
        y[j + 16] = (((int(qs[j]) >> 4) | xh_1) - 16) * d
    return y


def _q8_0(b: np.ndarray) -> list[float]:
    d = _f16(b, 0)
    return [int(q) * d for q in b[2:34].view(np.int8)]


def _q4_k(b: np.ndarray) -> list[float]:
    d, dmin, scales, q = _f16(b, 0), _f16(b, 2), b[4:16], b[16:144]
    y: list[float] = []
    for j in range(0, QK_K // 64):
        sc, m = _scale_min_k4(2 * j, scales)
        d1, m1 = d * sc, dmin * m
        sc, m = _scale_min_k4(2 * j + 1, scales)
        d2, m2 = d * sc, dmin * m
        part = q[32 * j : 32 * j + 32]
        y += [d1 * (int(x) & 0xF) - m1 for x in part]
        y += [d2 * (int(x) >> 4) - m2 for x in part]
    return y


def _q5_k(b: np.ndarray) -> list[float]:
    d, dmin, scales, qh, ql = _f16(b, 0), _f16(b, 2), b[4:16], b[16:48], b[48:176]
    y: list[float] = []
    u1, u2 = 1, 2
    for j in range(0, QK_K // 64):
        sc, m = _scale_min_k4(2 * j, scales)
        d1, m1 = d * sc, dmin * m
        sc, m = _scale_min_k4(2 * j + 1, scales)
        d2, m2 = d * sc, dmin * m
        part = ql[32 * j : 32 * j + 32]
        y += [
            d1 * ((int(x) & 0xF) + (16 if int(h) & u1 else 0)) - m1
            for x, h in zip(part, qh, strict=False)
        ]
        y += [
            d2 * ((int(x) >> 4) + (16 if int(h) & u2 else 0)) - m2
            for x, h in zip(part, qh, strict=False)
        ]
        u1, u2 = u1 << 2, u2 << 2
    return y


def _q6_k(b: np.ndarray) -> list[float]:
    ql, qh, sc, d = b[0:128], b[128:192], b[192:208].view(np.int8), _f16(b, 208)
    y = [0.0] * QK_K
    for n in range(2):  # two halves of 128 values
        lo, hi, s, out = ql[64 * n :], qh[32 * n :], sc[8 * n :], 128 * n
        for l in range(32):  # noqa: E741 (ggml's name)
            i = l // 16
            q1 = ((int(lo[l]) & 0xF) | ((int(hi[l]) >> 0 & 3) << 4)) - 32
            q2 = ((int(lo[l + 32]) & 0xF) | ((int(hi[l]) >> 2 & 3) << 4)) - 32
            q3 = ((int(lo[l]) >> 4) | ((int(hi[l]) >> 4 & 3) << 4)) - 32
            q4 = ((int(lo[l + 32]) >> 4) | ((int(hi[l]) >> 6 & 3) << 4)) - 32
            y[out + l] = d * int(s[i]) * q1
            y[out + l + 32] = d * int(s[i + 2]) * q2
            y[out + l + 64] = d * int(s[i + 4]) * q3
            y[out + l + 96] = d * int(s[i + 6]) * q4
    return y


DECODERS = {
    "Q4_0": _q4_0,
    "Q5_0": _q5_0,
    "Q8_0": _q8_0,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
}


def decode(kind: str, raw: np.ndarray) -> np.ndarray:
    """float64 [rows, values] of `raw` (uint8 [rows, bytes]) decoded block by block."""
    _values, size = BLOCKS[kind]
    blocks = raw.reshape(raw.shape[0], -1, size)
    out = [[v for block in row for v in DECODERS[kind](block)] for row in blocks]
    return np.asarray(out, dtype=np.float64)
