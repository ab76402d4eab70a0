"""One call of the GGUF block kernel on a decode-shaped layer: one input row times a
2048 x 8192 Q4_K weight (SmolLM2-1.7B's FFN down projection; random valid blocks), with
the AVX2 build and, where the CPU has it, the AVX-512 VNNI build, beside fp32 `F.linear` on
the same shape. Calls alternate so that the machine's drift hits all alike; medians.
    .venv/bin/python scripts/gguf_kernel_speed.py [--calls 300] [--rows 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from pagedllm.kernels.cpu import load_cpu_ops
from pagedllm.kernels.gguf_blocks import block_geometry, gguf_linear

OUT, IN = 2048, 8192


# Where each type's fp16 scales lie in its block (Q4_K: d and dmin first; Q6_K: d last).
FP16_FIELDS = {GGMLQuantizationType.Q4_K: (0, 2), GGMLQuantizationType.Q6_K: (208, 1)}


def random_blocks(kind: GGMLQuantizationType, out: int, k: int) -> torch.Tensor:
    """Random bytes as [out, k] weights of a K-quant, with small finite fp16 scales."""
    values, size = block_geometry(kind)
    start, count = FP16_FIELDS[kind]
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (out, k // values, size), dtype=np.uint8)
    scales = rng.uniform(0.001, 0.02, (out, k // values, count)).astype(np.float16)
    raw[:, :, start : start + 2 * count] = scales.view(np.uint8)
    return torch.from_numpy(raw.reshape(out, -1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rows", type=int, default=1)
    args = parser.parse_args()
    weight = random_blocks(GGMLQuantizationType.Q4_K, OUT, IN)
    dense = torch.randn(OUT, IN)
    x = torch.randn(args.rows, IN)
    cases = {"q4_k avx2": lambda: gguf_linear(x, weight, GGMLQuantizationType.Q4_K, OUT, "avx2")}
    if load_cpu_ops().int8_has_vnni()[0]:
        cases["q4_k vnni"] = lambda: gguf_linear(x, weight, GGMLQuantizationType.Q4_K, OUT, "vnni")
    cases["fp32 F.linear"] = lambda: F.linear(x, dense)
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(10):
        for call in cases.values():
            call()
    for _ in range(args.calls):
        for name, call in cases.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        info = f.read()
    model = next(
        line.split(":", 1)[1].strip() for line in info.splitlines() if "model name" in line
    )
    print(f"{model}; AVX-512 VNNI: {'avx512_vnni' in info}; {torch.get_num_threads()} threads")
    print(
        f"{args.rows} row(s) x [{OUT}, {IN}]: Q4_K {weight.numel() / 1e6:.1f} MB, fp32 "
        f"{dense.numel() * 4 / 1e6:.1f} MB"
    )
    for name, samples in times.items():
        print(f"{name:14s} median {statistics.median(samples) * 1e6:8.1f} us")


if __name__ == "__main__":
    main()
