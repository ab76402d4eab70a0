"""How fast the GGUF kernels multiply when memory is not what limits them: one thread, N
input rows times a 256 x 2048 weight held in L2 from call to call (random valid blocks), less
each call's fixed cost (the same call on 16 weight rows); the AVX2 build and, where the CPU
has it, the AVX-512 VNNI build. Q4_K in the interleaved layout it takes at load (295 KB); Q6_K
in the file's layout (430 KB), which its one-row and few-row dots read. Calls alternate so
that the machine's drift hits all cases alike; medians.
    .venv/bin/python scripts/gguf_kernel_ceiling.py [--type Q4_K|Q6_K] [--rows 1,2,4,8,64]
        [--calls 2000]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from gguf import GGMLQuantizationType
from gguf_kernel_speed import random_blocks

from pagedllm.kernels.cpu import load_cpu_ops
from pagedllm.kernels.gguf_blocks import interleave

IN, OUT, FIXED_OUT = 2048, 256, 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--type", choices=["Q4_K", "Q6_K"], default="Q4_K")
    parser.add_argument("--rows", default="1,2,4,8,64")
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    ops = load_cpu_ops()
    builds = ["avx2", "vnni"] if ops.int8_has_vnni()[0] else ["avx2"]
    kind = GGMLQuantizationType[args.type]
    weights = {out: random_blocks(kind, out, IN) for out in (OUT, FIXED_OUT)}
    if kind == GGMLQuantizationType.Q4_K:
        weights = {out: interleave(weight, kind) for out, weight in weights.items()}
    cases = [(b, int(r), out) for b in builds for r in args.rows.split(",") for out in weights]
    inputs = {rows: torch.randn(rows, IN) for _, rows, _ in cases}

    def call(build: str, rows: int, out: int) -> None:
        ops.gguf_linear_parts(inputs[rows], [weights[out]], [int(kind)], build)

    for case in cases:
        for _ in range(20):
            call(*case)
    times: dict[tuple[str, int, int], list[float]] = {case: [] for case in cases}
    for _ in range(args.calls):
        for case in cases:
            start = time.perf_counter()
            call(*case)
            times[case].append(time.perf_counter() - start)
    median = {case: statistics.median(samples) for case, samples in times.items()}
    layout = "interleaved" if kind == GGMLQuantizationType.Q4_K else "in the file's layout"
    print(f"one thread, [{OUT}, {IN}] {args.type} {layout}, less the [{FIXED_OUT}, {IN}] call")
    for build in builds:
        for rows in dict.fromkeys(rows for b, rows, _ in cases if b == build):
            full, fixed = median[(build, rows, OUT)], median[(build, rows, FIXED_OUT)]
            products = rows * (OUT - FIXED_OUT) * IN
            print(
                f"{build} {rows:3d} row(s): {full * 1e6:7.1f} us a call, {fixed * 1e6:5.1f} us "
                f"fixed, {products / (full - fixed) / 1e9:6.1f} G multiply-adds/s"
            )


if __name__ == "__main__":
    main()
