"""The GGUF block kernels' two methods side by side on SmolLM2-1.7B's layer shapes (hidden
2048, FFN 8192; random valid blocks): "gemv" (each weight block unpacked once per input
row) against "gemm" (once for several rows), at several row counts, on the AVX2 build and,
where the CPU has it, the AVX-512 VNNI build. The two methods' calls alternate on the same
tensors so that the machine's drift hits both alike; ms per call are medians.
    .venv/bin/python scripts/gguf_gemm_speed.py [--types Q4_K Q6_K] [--rows 1 8 16 64 128 512]
        [--threads N] [--budget SECONDS]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import numpy as np
import torch
from gguf import GGMLQuantizationType

from pagedllm.kernels.cpu import load_cpu_ops
from pagedllm.kernels.gguf_blocks import block_geometry, gguf_linear

# [out, in]: the attention output projection, gate or up, and down.
SHAPES = ((2048, 2048), (8192, 2048), (2048, 8192))
# Byte offsets of each type's fp16 scales in a block.
F16_FIELDS = {
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    "Q8_0": (0,),
    "Q4_0": (0,),
    "Q5_0": (0,),
    "Q4_1": (0, 2),
}


def random_blocks(ggml_type: GGMLQuantizationType, out: int, k: int) -> torch.Tensor:
    """Random bytes as `ggml_type` blocks, every fp16 scale small and finite."""
    values, size = block_geometry(ggml_type)
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (out, k // values, size), dtype=np.uint8)
    for at in F16_FIELDS[ggml_type.name]:
        scale = rng.uniform(0.001, 0.02, (out, k // values, 1)).astype(np.float16)
        raw[:, :, at : at + 2] = scale.view(np.uint8)
    return torch.from_numpy(raw.reshape(out, -1))


def median_ms(calls: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in calls}
    for call in calls.values():
        call()
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", nargs="+", default=["Q4_K", "Q6_K"], choices=F16_FIELDS)
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 8, 16, 64, 128, 512])
    parser.add_argument("--budget", type=float, default=0.5, help="seconds per case, about")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        info = f.read()
    model = next(
        line.split(":", 1)[1].strip() for line in info.splitlines() if "model name" in line
    )
    builds = ["avx2", "vnni"] if load_cpu_ops().int8_has_vnni()[0] else ["avx2"]
    print(f"{model}; {torch.get_num_threads()} threads; builds: {', '.join(builds)}")
    print(
        f"{'type':5s} {'[out, in]':>12s} {'rows':>5s} {'build':5s} {'gemv ms':>9s} "
        f"{'gemm ms':>9s} {'gemv/gemm':>9s}"
    )
    for name in args.types:
        ggml_type = GGMLQuantizationType[name]
        for out, k in SHAPES:
            weight = random_blocks(ggml_type, out, k)
            for rows in args.rows:
                x = torch.randn(rows, k)
                for build in builds:
                    calls = {
                        method: partial(gguf_linear, x, weight, ggml_type, out, build, method)
                        for method in ("gemv", "gemm")
                    }
                    start = time.perf_counter()
                    for call in calls.values():
                        call()
                    once = time.perf_counter() - start
                    repeats = max(3, min(200, int(args.budget / max(once, 1e-6))))
                    ms = median_ms(calls, repeats)
                    print(
                        f"{name:5s} {f'[{out}, {k}]':>12s} {rows:5d} {build:5s} "
                        f"{ms['gemv']:9.3f} {ms['gemm']:9.3f} {ms['gemv'] / ms['gemm']:9.2f}",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
