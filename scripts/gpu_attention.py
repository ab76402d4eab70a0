"""Decode-attention timing on CUDA for scripts/gpu_check.sh: the Triton paged kernel
against the device's copy bandwidth.

Decode attention reads every cached K and V once; bytes moved over time gives the
achieved bandwidth, printed beside a device-to-device copy's (the practical ceiling).
Shapes: SmolLM2-135M's heads (9 query, 3 KV, head_dim 64) and a Llama-8B-like layer
(32 query, 8 KV, head_dim 128), long contexts, fp16 and bf16 caches, block size 16.
"""

from __future__ import annotations

import functools

import torch
import triton.testing

from pagedllm.attention.backends import AttentionBackend
from pagedllm.attention.metadata import build_attention_metadata
from pagedllm.attention.reference import ReferenceAttention
from pagedllm.attention.triton_backend import TritonPagedAttention

BLOCK = 16


def copy_bandwidth() -> float:
    src = torch.randn(1 << 28, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * src.numel() * 4 / ms / 1e6  # GB/s, read + write


def case(
    attn: AttentionBackend,
    heads: int,
    kv_heads: int,
    d: int,
    batch: int,
    ctx: int,
    dtype: torch.dtype,
) -> tuple:
    per_seq = -(-ctx // BLOCK)
    blocks = batch * per_seq
    perm = torch.randperm(blocks).view(batch, per_seq).tolist()
    k_cache = torch.randn(blocks, BLOCK, kv_heads, d, device="cuda", dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    meta = build_attention_metadata(
        [ctx - 1] * batch,
        [1] * batch,
        perm,
        range(batch),
        BLOCK,
        device="cuda",
        dtype=dtype,
    )
    q = torch.randn(batch, heads, d, device="cuda", dtype=dtype)
    k = torch.randn(batch, kv_heads, d, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    return q, k, v, k_cache, v_cache, attn.prepare(meta)  # the backend's plan of the step


def main() -> None:
    peak = copy_bandwidth()
    print(f"device-to-device copy: {peak:.0f} GB/s")
    print("| shape | dtype | batch | context | ms | GB/s | % of copy | rel. err vs reference |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (heads, kvh, d) in {"smollm2": (9, 3, 64), "llama-8b": (32, 8, 128)}.items():
        for dtype in (torch.float16, torch.bfloat16):
            for batch, ctx in ((1, 32768), (16, 8192), (64, 4096), (256, 2048)):
                attn = TritonPagedAttention(heads, kvh, d, d**-0.5, torch.device("cuda"))
                q, k, v, kc, vc, plan = case(attn, heads, kvh, d, batch, ctx, dtype)
                out = attn(q, k, v, kc, vc, plan)
                ref_meta = build_attention_metadata(
                    [ctx - 1] * batch,
                    [1] * batch,
                    plan.meta.block_tables.tolist(),
                    range(batch),
                    BLOCK,
                    device="cuda",
                    dtype=torch.float32,
                )
                reference = ReferenceAttention(d**-0.5)
                ref = reference(
                    q.float(),
                    k.float(),
                    v.float(),
                    kc.float(),
                    vc.float(),
                    reference.prepare(ref_meta),
                )
                err = ((out.float() - ref).norm() / ref.norm()).item()
                call = functools.partial(attn, q, k, v, kc, vc, plan)
                ms = triton.testing.do_bench(call, return_mode="median")
                moved = 2 * batch * ctx * kvh * d * kc.element_size()
                gbs = moved / ms / 1e6
                print(
                    f"| {name} | {str(dtype)[6:]} | {batch} | {ctx} | {ms:.3f} | {gbs:.0f} | "
                    f"{100 * gbs / peak:.0f}% | {err:.1e} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
