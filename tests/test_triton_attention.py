"""The Triton kernels equal the reference: on a CUDA GPU when there is one, else on CPU
tensors under Triton's interpreter (TRITON_INTERPRET=1, small shapes: it is slow).

Random flat batches as for the CPU kernel (mixed decode and chunked prefill, shuffled
blocks, stale values and NaN in unused slots, GQA, half-precision caches), the split
decode path with its reduction kernel, and the K/V write kernel.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    # Must be set before the kernels are defined: the interpreter replaces the compiler.
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attention_cases import make_case
from pagedllm import LLM, SamplingParams
from pagedllm.attention import triton_backend
from pagedllm.attention.reference import ReferenceAttention
from pagedllm.attention.triton_backend import TritonPagedAttention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def compare(
    shapes, heads, kv_heads, head_dim, block_size, seed, cache_dtype, dtype, window=None
) -> None:
    """Triton against the reference; with a window, Triton runs on a pool poisoned behind
    it (NaN: it must read none of it)."""
    case = make_case(
        shapes,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        seed=seed,
        dtype=dtype,
        cache_dtype=cache_dtype,
        device=DEVICE,
    )
    k_ref, v_ref = case.fresh_caches()
    k_tri, v_tri = case.fresh_caches() if window is None else case.poisoned_caches(window)
    ref = ReferenceAttention(case.scale)
    tri = TritonPagedAttention(heads, kv_heads, head_dim, case.scale, torch.device(DEVICE))
    q, k, v = case.query, case.key, case.value
    expected = ref(q, k, v, k_ref, v_ref, ref.prepare(case.meta), window)
    got = tri(q, k, v, k_tri, v_tri, tri.prepare(case.meta), window)
    assert not got.isnan().any()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)
    if window is None:
        assert torch.equal(k_tri.nan_to_num(7.0), k_ref.nan_to_num(7.0))
        assert torch.equal(v_tri.nan_to_num(7.0), v_ref.nan_to_num(7.0))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shapes=st.lists(
        st.tuples(st.integers(0, 200), st.sampled_from([1, 1, 3, 17, 33])), min_size=1, max_size=4
    ),
    block_size=st.sampled_from([1, 8, 16, 32]),
    gqa=st.sampled_from([(4, 4), (9, 3), (8, 2)]),
    head_dim=st.sampled_from([64, 128]),
    cache_dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_triton_equals_reference(shapes, block_size, gqa, head_dim, cache_dtype, seed) -> None:
    compare(shapes, *gqa, head_dim, block_size, seed, cache_dtype, torch.float32)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shapes=st.lists(
        st.tuples(st.integers(0, 120), st.sampled_from([1, 1, 3, 17, 33])), min_size=1, max_size=3
    ),
    block_size=st.sampled_from([1, 8, 16]),
    gqa=st.sampled_from([(4, 4), (8, 2)]),
    window=st.sampled_from([1, 5, 8, 40]),
    seed=st.integers(0, 2**16),
)
def test_triton_with_a_window_equals_reference(shapes, block_size, gqa, window, seed) -> None:
    compare(shapes, *gqa, 32, block_size, seed, torch.float32, torch.float32, window)


def test_split_decode_with_a_window_is_merged_exactly() -> None:
    """The split parts wholly behind the window are empty; the merge still equals."""
    for window in (1, 100):
        compare([(1200, 1)], 8, 2, 64, 16, 1, torch.float32, torch.float32, window)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_with_a_half_precision_model(dtype: torch.dtype) -> None:
    compare([(40, 1), (0, 20), (70, 5)], 8, 2, 64, 16, 0, dtype, dtype)


class CountingLaunches:
    """Stands in for a Triton kernel and counts its launches (`kernel[grid](...)`)."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.launches = 0

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        self.launches += 1
        return self.kernel[grid]


def test_split_decode_is_merged_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    """One long decode and two KV heads: too few programs, so the context is split."""
    merge = CountingLaunches(triton_backend.merge_splits_kernel)
    monkeypatch.setattr(triton_backend, "merge_splits_kernel", merge)
    compare([(1200, 1)], 8, 2, 64, 16, 1, torch.float32, torch.float32)
    assert merge.launches == 1  # the split happened (else the merge has nothing to do)
    compare([(700, 1), (900, 1)], 9, 3, 64, 8, 2, torch.float16, torch.float32)
    assert merge.launches == 2


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_the_engine_on_triton_generates_what_the_reference_does(arch, family_dir) -> None:
    """Gemma 3 mixes windowed (8 tokens) and full layers, past the window."""
    prompts = [[1, 2, 3, 4, 5], [7] * 40, [9, 8, 7]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs = {}
    for backend in ("reference", "triton"):
        llm = LLM(
            str(family_dir(arch)),
            device=DEVICE,
            attention_backend=backend,
            block_size=8,
            max_num_batched_tokens=16,  # the long prompt is prefilled in chunks
            num_kv_blocks=64,
        )
        outs = llm.generate(prompts, params, use_tqdm=False)
        outputs[backend] = [o.outputs[0].token_ids for o in outs]
        assert llm.engine.kv.num_free_blocks == 64
    assert outputs["triton"] == outputs["reference"]
