"""How fast the GGUF kernels stream each kind of tensor of a file: `--rows` input rows (1, a
decode step; 512, a prompt) times every linear weight of the file (its blocks as the engine
holds them, one kernel call each: Q4_1 and Q4_K interleaved where their rows come in
groups of 16; `--file-rows`: every tensor in the file's rows), grouped by block type and
input width; the best of three passes, on torch's threads.
    .venv/bin/python scripts/gguf_tensor_speed.py MODEL.gguf [--rows 512] [--file-rows]
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

from pagedllm.kernels.cpu import load_cpu_ops
from pagedllm.kernels.gguf_blocks import INTERLEAVED_GROUP_ROWS, INTERLEAVED_TYPES, interleave
from pagedllm.loader import load_model
from pagedllm.model.gguf_linear import GGUFWeight


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model")
    parser.add_argument("--rows", type=int, default=1, help="input rows per call")
    parser.add_argument("--file-rows", action="store_true", help="no tensor interleaved")
    args = parser.parse_args()
    ops = load_cpu_ops()
    weights = load_model(args.model, keep_quantized=True).weights
    groups: dict[tuple[str, int], list[GGUFWeight]] = collections.defaultdict(list)
    for name, w in weights.items():
        if isinstance(w, GGUFWeight) and name != "model.embed_tokens.weight":
            groups[(w.ggml_type.name, w.in_features)].append(w)
    held = {
        id(w): interleave(w.blocks.contiguous(), w.ggml_type)
        if not args.file_rows
        and w.ggml_type in INTERLEAVED_TYPES
        and w.shape[0] % INTERLEAVED_GROUP_ROWS == 0
        else w.blocks
        for tensors in groups.values()
        for w in tensors
    }
    total = 0.0
    for (kind, width), tensors in sorted(groups.items()):
        x = torch.randn(args.rows, width)
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            for w in tensors:
                ops.gguf_linear_parts(x, [held[id(w)]], [int(w.ggml_type)], "auto")
            best = min(best, time.perf_counter() - start)
        size = sum(w.blocks.numel() for w in tensors)
        ops_done = 2 * args.rows * width * sum(w.blocks.shape[0] for w in tensors)
        total += best
        print(
            f"{kind}, {width} inputs: {len(tensors)} tensors, {size / 1e6:.0f} MB, "
            f"{best * 1e3:.1f} ms, {size / best / 1e9:.1f} GB/s, {ops_done / best / 1e9:.0f} GOP/s"
        )
    print(f"all: {total * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
