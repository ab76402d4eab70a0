"""The int8 GEMMs alone on the default model's shapes (docs/kernels.md's int8 GEMM table):
ms for one decode step's linear layers (qkv, o, gate_up, down x 30 layers, plus lm_head)
at each row count, per kernel, beside fp32 `F.linear`, measured side by side (alternating,
best of 3) by the same code that chooses the kernel at load (kernels/int8_choice.py).
    .venv/bin/python scripts/int8_gemm.py --rows 64,256 [--int-mm]
`--int-mm` adds torch's `_int_mm` (a plain loop without AVX-512 VNNI: seconds per step).
Run with PAGEDLLM_NO_VNNI=1 ATEN_CPU_CAPABILITY=avx2 to see an AVX2-only CPU's kernels.
"""

from __future__ import annotations

import argparse

import torch

from pagedllm.kernels import int8_choice
from pagedllm.kernels.cpu import load_cpu_ops

# SmolLM2-135M: hidden 576, intermediate 1536, 9 heads and 3 KV heads of 64, vocab 49152.
SHAPES = {"qkv": (960, 576, 30), "o": (576, 576, 30), "gate_up": (3072, 576, 30)}
SHAPES |= {"down": (576, 1536, 30), "lm_head": (49152, 576, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="64,256", help="row counts (default: 64,256)")
    parser.add_argument("--int-mm", action="store_true", help="time torch's _int_mm too")
    args = parser.parse_args()
    ops = load_cpu_ops()
    cpu_vnni, use_vnni = ops.int8_has_vnni()
    gemms = int8_choice.candidates(use_vnni) | ({"_int_mm": None} if args.int_mm else {})
    gen = torch.Generator().manual_seed(0)
    weights = {
        name: (torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen), count)
        for name, (n, k, count) in SHAPES.items()
    }
    print(
        f"CPU: {int8_choice.cpu_model_name()}; VNNI: {cpu_vnni}, used: {use_vnni}; "
        f"torch dispatch: {torch.backends.cpu.get_cpu_capability()}; "
        f"threads: {torch.get_num_threads()}"
    )
    print("| rows | layers | fp32 F.linear ms | " + " | ".join(f"{g} ms" for g in gemms) + " |")
    print("|---" * (3 + len(gemms)) + "|")
    for rows in (int(r) for r in args.rows.split(",")):
        totals = dict.fromkeys(["fp32", *gemms], 0.0)
        for name, layer in weights.items():
            step_ms, fp32_ms = int8_choice.measure(ops, [layer], gemms, repeats=3, rows=rows)
            cells = " | ".join(f"{step_ms[g]:.1f} ({step_ms[g] / fp32_ms:.2f}x)" for g in gemms)
            print(f"| {rows} | {name} x{layer[1]} | {fp32_ms:.1f} | {cells} |")
            totals["fp32"] += fp32_ms
            for g in gemms:
                totals[g] += step_ms[g]
        cells = " | ".join(
            f"**{totals[g]:.1f} ({totals[g] / totals['fp32']:.2f}x)**" for g in gemms
        )
        print(f"| {rows} | all | **{totals['fp32']:.1f}** | {cells} |")


if __name__ == "__main__":
    main()
