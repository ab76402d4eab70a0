"""How close the GGUF gemm method comes to the int8 multiply-adds one core can issue.

A loop of independent multiply-add chains (assembly, compiled here with the system
compiler) gives one core's ceiling for each build's instruction: AVX-512 VNNI's vpdpbusd
(64 products a zmm instruction) and AVX2's vpmaddubsw pair summed in 16 bits then widened
by vpmaddwd (64 products in five instructions, as the AVX2 kernels do). Then the gemm
method runs on one thread over SmolLM2-1.7B's gate/up shape ([8192, 2048]) at several row
counts, and its products per second are printed as a share of its build's ceiling,
measured in the same run (so the share moves less than the rates on a busy machine). No
memory is read in the ceiling loops: a share near 1 would mean the kernel is bound by its
multiply-adds, and no other order of its loops could make it faster on this CPU.
    .venv/bin/python scripts/int8_mac_ceiling.py [--types Q4_K Q4_1] [--rows 64 512]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from gguf import GGMLQuantizationType

from pagedllm.kernels.cpu import load_cpu_ops
from pagedllm.kernels.gguf_blocks import INTERLEAVED_TYPES, gguf_linear, interleave

sys.path.insert(0, str(Path(__file__).parent))
from gguf_gemm_speed import random_blocks

CEILING_C = r"""
#include <stdio.h>
#include <string.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

// Twelve independent accumulators, in assembly so that no compiler can hoist or merge them.
#define DP(r) "vpdpbusd %%zmm0, %%zmm1, %%zmm" #r "\n\t"
static double vnni(long n) {
  const double t = now();
  for (long k = 0; k < n; ++k)
    __asm__ volatile(DP(2) DP(3) DP(4) DP(5) DP(6) DP(7) DP(8) DP(9) DP(10) DP(11) DP(12) DP(13)
                     ::: "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",
                         "xmm10", "xmm11", "xmm12", "xmm13");
  return 64.0 * 12 * n / (now() - t);
}

// Six independent chains of the AVX2 kernels' step: two vpmaddubsw summed in 16 bits,
// widened by vpmaddwd, added to an int32 accumulator (64 products).
#define MA(p, a)                                               \
  "vpmaddubsw %%ymm0, %%ymm1, %%ymm" #p "\n\t"                 \
  "vpmaddubsw %%ymm1, %%ymm0, %%ymm14\n\t"                     \
  "vpaddw %%ymm14, %%ymm" #p ", %%ymm" #p "\n\t"               \
  "vpmaddwd %%ymm15, %%ymm" #p ", %%ymm" #p "\n\t"             \
  "vpaddd %%ymm" #p ", %%ymm" #a ", %%ymm" #a "\n\t"
static double avx2(long n) {
  const double t = now();
  for (long k = 0; k < n; ++k)
    __asm__ volatile(MA(2, 8) MA(3, 9) MA(4, 10) MA(5, 11) MA(6, 12) MA(7, 13)
                     ::: "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",
                         "xmm10", "xmm11", "xmm12", "xmm13", "xmm14");
  return 64.0 * 6 * n / (now() - t);
}

int main(int argc, char** argv) {
  const long n = 20000000;
  printf("%f\n", (argc > 1 && strcmp(argv[1], "vnni") == 0 ? vnni(n) : avx2(n)) / 1e9);
  return 0;
}
"""


def ceilings(builds: list[str]) -> dict[str, float]:
    """G multiply-adds per second one core issues, per build (the best of three runs)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise SystemExit("no C compiler (cc) on PATH")
    with tempfile.TemporaryDirectory() as work:
        source, binary = Path(work) / "ceiling.c", Path(work) / "ceiling"
        source.write_text(CEILING_C)
        subprocess.run([compiler, "-O2", str(source), "-o", str(binary)], check=True)

        def run(build: str) -> float:
            done = subprocess.run([binary, build], capture_output=True, text=True, check=True)
            return float(done.stdout)

        return {build: max(run(build) for _ in range(3)) for build in builds}


def gemm_rate(ggml_type: GGMLQuantizationType, rows: int, build: str, budget: float) -> float:
    """G multiply-adds per second of the gemm method on one thread, [8192, 2048] weights
    as the engine holds them (interleaved where the type is), the best of its calls."""
    out, k = 8192, 2048
    weight = random_blocks(ggml_type, out, k)
    if ggml_type in INTERLEAVED_TYPES:
        weight = interleave(weight, ggml_type)
    x = torch.randn(rows, k)
    gguf_linear(x, weight, ggml_type, out, build, "gemm")
    best, spent = float("inf"), 0.0
    while spent < budget:
        start = time.perf_counter()
        gguf_linear(x, weight, ggml_type, out, build, "gemm")
        took = time.perf_counter() - start
        best, spent = min(best, took), spent + took
    return out * k * rows / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", nargs="+", default=["Q4_K", "Q4_1"])
    parser.add_argument("--rows", nargs="+", type=int, default=[64, 512])
    parser.add_argument("--budget", type=float, default=1.0, help="seconds per case, about")
    args = parser.parse_args()
    torch.set_num_threads(1)
    builds = ["avx2", "vnni"] if load_cpu_ops().int8_has_vnni()[0] else ["avx2"]
    ceiling = ceilings(builds)
    for build in builds:
        print(f"{build} ceiling, one core: {ceiling[build]:.1f} G multiply-adds/s")
    print(f"{'type':5s} {'rows':>5s} {'build':5s} {'G mult-adds/s':>14s} {'of ceiling':>10s}")
    for name in args.types:
        for rows in args.rows:
            for build in builds:
                rate = gemm_rate(GGMLQuantizationType[name], rows, build, args.budget)
                print(f"{name:5s} {rows:5d} {build:5s} {rate:14.1f} {rate / ceiling[build]:10.2f}")


if __name__ == "__main__":
    main()
