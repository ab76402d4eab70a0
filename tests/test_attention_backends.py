"""Every faster attention backend equals the reference on random flat batches: decode
rows and chunked prefill mixed, shuffled blocks, contexts ending mid-block, stale values
and NaN in unused slots, block sizes 1 to 32, GQA 1:1 to 4:1, head_dim 64 and 128,
float32 and half-precision KV caches. Also: the backend choice and its fallback."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attention_cases import Case, make_case
from hf_oracle import make_tiny_model
from pagedllm.attention.backends import select_attention
from pagedllm.attention.cpu import CpuPagedAttention
from pagedllm.attention.reference import ReferenceAttention
from pagedllm.errors import InvalidParameterError
from pagedllm.kernels.cpu import load_cpu_ops, missing_cpu_features

needs_cpu_kernel = pytest.mark.skipif(
    bool(missing_cpu_features()), reason=f"this CPU lacks {missing_cpu_features()}"
)
HALF = (torch.float16, torch.bfloat16)


def run_both(
    case: Case, heads: int, kv_heads: int, window: int | None = None
) -> tuple[torch.Tensor, ...]:
    """The reference's and the CPU kernel's outputs, and their caches after the write;
    with a window, the kernel runs on a pool poisoned behind it (it must not read there)."""
    k_ref, v_ref = case.fresh_caches()
    k_cpu, v_cpu = case.fresh_caches() if window is None else case.poisoned_caches(window)
    ref = ReferenceAttention(case.scale)
    cpu = CpuPagedAttention(kv_heads, case.scale, load_cpu_ops().paged_attention)
    q, k, v = case.query, case.key, case.value
    expected = ref(q, k, v, k_ref, v_ref, ref.prepare(case.meta), window)
    got = cpu(q, k, v, k_cpu, v_cpu, cpu.prepare(case.meta), window)
    return expected, got, k_ref, k_cpu, v_ref, v_cpu


shapes = st.lists(
    st.tuples(
        st.integers(0, 300), st.one_of(st.just(1), st.just(1), st.integers(1, 40))
    ),  # (cached, new): mostly decodes
    min_size=1,
    max_size=6,
)


@needs_cpu_kernel
@settings(max_examples=70, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shapes=shapes,
    block_size=st.sampled_from([1, 8, 16, 32]),
    gqa=st.sampled_from([(4, 4), (9, 3), (8, 2)]),
    head_dim=st.sampled_from([64, 128]),
    cache_dtype=st.sampled_from([torch.float32, *HALF]),
    seed=st.integers(0, 2**16),
    window=st.sampled_from([None, None, 1, 3, 8, 16, 40, 100]),
)
def test_cpu_kernel_equals_reference(
    shapes, block_size, gqa, head_dim, cache_dtype, seed, window
) -> None:
    """With a window, keys behind each query's window are masked, and the kernel reads
    none of those behind its first row's window (NaN in its pool)."""
    heads, kv_heads = gqa
    case = make_case(
        shapes,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        seed=seed,
        cache_dtype=cache_dtype,
    )
    expected, got, k_ref, k_cpu, v_ref, v_cpu = run_both(case, heads, kv_heads, window)
    assert not got.isnan().any()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    if window is None:  # else the kernel's pool was poisoned on purpose
        assert torch.equal(k_cpu.nan_to_num(7.0), k_ref.nan_to_num(7.0))
        assert torch.equal(v_cpu.nan_to_num(7.0), v_ref.nan_to_num(7.0))


@needs_cpu_kernel
def test_split_decodes_with_a_window_merge_exactly() -> None:
    """Long decodes split along their context: the parts wholly behind the window are
    empty, and the merge still equals the reference."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        case = make_case([(3000, 1), (700, 1)], heads=9, kv_heads=3, head_dim=64, block_size=16)
        for window in (1, 50, 1000):
            expected, got, *_ = run_both(case, 9, 3, window)
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    finally:
        torch.set_num_threads(threads)


def test_the_reference_window_masks_exactly_the_keys_behind_it() -> None:
    """The reference with window W equals dense attention over keys (p - W, p]."""
    shapes = [(20, 1), (0, 12), (9, 7)]
    case = make_case(shapes, heads=2, kv_heads=1, head_dim=8, block_size=4)
    ref = ReferenceAttention(case.scale)
    k_cache, v_cache = case.fresh_caches()
    window = 5
    out = ref(case.query, case.key, case.value, k_cache, v_cache, ref.prepare(case.meta), window)
    meta, qsl = case.meta, case.meta.host_query_start_loc
    for i, (cached, new) in enumerate(shapes):
        ctx = cached + new
        table = meta.host_block_tables[i]
        slots = [int(table[j // 4]) * 4 + j % 4 for j in range(ctx)]
        keys = k_cache.view(-1, 1, 8)[slots, 0]  # [ctx, d]
        values = v_cache.view(-1, 1, 8)[slots, 0]
        for r in range(new):
            p = cached + r
            q = case.query[int(qsl[i]) + r]  # [heads, d]
            lo = max(0, p - window + 1)
            scores = (q @ keys[lo : p + 1].T) * case.scale
            expected = torch.softmax(scores, -1) @ values[lo : p + 1]
            torch.testing.assert_close(out[int(qsl[i]) + r], expected, atol=1e-6, rtol=1e-5)


@needs_cpu_kernel
@pytest.mark.parametrize("dtype", HALF)
def test_cpu_kernel_with_a_half_precision_model(dtype: torch.dtype) -> None:
    shapes = [(37, 1), (0, 19), (120, 1), (16, 9)]
    case = make_case(shapes, heads=8, kv_heads=2, head_dim=64, block_size=16, dtype=dtype)
    expected, got, *_ = run_both(case, 8, 2)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)


@needs_cpu_kernel
@pytest.mark.parametrize("cache_dtype", [torch.float32, *HALF])
def test_the_kernel_writes_kv_given_as_views_of_a_fused_projection(cache_dtype) -> None:
    """The model hands q, k and v as views of one [T, (H + 2 * KVH) * D] projection: the
    kernel's own K/V write follows their strides into exactly the reference's slots."""
    case = make_case(
        [(20, 1), (0, 7), (33, 2)],
        heads=9,
        kv_heads=3,
        head_dim=64,
        block_size=8,
        seed=3,
        cache_dtype=cache_dtype,
    )
    tokens = case.query.shape[0]
    fused = torch.cat([t.reshape(tokens, -1) for t in (case.query, case.key, case.value)], 1)
    q, k, v = fused.split([9 * 64, 3 * 64, 3 * 64], dim=1)
    views = [t.view(tokens, -1, 64) for t in (q, k, v)]
    assert not views[1].is_contiguous()
    k_ref, v_ref = case.fresh_caches()
    k_cpu, v_cpu = case.fresh_caches()
    ref = ReferenceAttention(case.scale)
    cpu = CpuPagedAttention(3, case.scale, load_cpu_ops().paged_attention)
    expected = ref(case.query, case.key, case.value, k_ref, v_ref, ref.prepare(case.meta))
    got = cpu(*views, k_cpu, v_cpu, cpu.prepare(case.meta))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    for mine, theirs in ((k_cpu, k_ref), (v_cpu, v_ref)):  # NaN marks the unwritten slots
        assert torch.equal(mine.nan_to_num(7.0), theirs.nan_to_num(7.0))


@needs_cpu_kernel
@pytest.mark.parametrize("shapes", [[(3000, 1)], [(700, 1), (2000, 1), (5, 1)]])
def test_long_decodes_split_along_the_context_merge_exactly(shapes) -> None:
    """Few, long decode rows with fewer KV heads than the parts wanted: the plan splits
    their contexts across the threads, and the kernel's merge of the parts equals the
    reference."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        case = make_case(shapes, heads=3, kv_heads=1, head_dim=64, block_size=16)
        plan = CpuPagedAttention(1, case.scale, load_cpu_ops().paged_attention).prepare(case.meta)
        assert plan.splits >= 2  # the split happened
        assert plan.merges.shape[0] >= 1
        expected, got, *_ = run_both(case, 3, 1)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    finally:
        torch.set_num_threads(threads)


@needs_cpu_kernel
def test_a_lone_short_decode_is_cut_into_ranges_of_heads_with_the_same_bits() -> None:
    """One decode row on two threads: four items, one per KV head (two per thread), no
    merge; the output is the very bits of the same row computed whole on one thread."""
    threads = torch.get_num_threads()
    case = make_case([(40, 1)], heads=8, kv_heads=4, head_dim=64, block_size=16)
    cpu = CpuPagedAttention(4, case.scale, load_cpu_ops().paged_attention)
    outputs = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            plan = cpu.prepare(case.meta)
            ranges = sorted((g0, g1) for _, g0, g1, *_ in plan.items.tolist())
            assert ranges == ([(0, 4)] if n == 1 else [(0, 1), (1, 2), (2, 3), (3, 4)])
            assert plan.merges.shape[0] == 0 and plan.splits == 1
            k, v = case.fresh_caches()
            outputs.append(cpu(case.query, case.key, case.value, k, v, plan))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outputs[0], outputs[1])


def test_the_cpu_plan_covers_every_query_row_and_key_once() -> None:
    """Each (sequence, KV head, query row) is in exactly one item or split, and a split
    row's parts tile its context without gaps or overlaps."""
    shapes = [(3000, 1), (0, 40), (17, 1), (100, 33)]
    case = make_case(shapes, heads=4, kv_heads=2, head_dim=64, block_size=16)
    plan = CpuPagedAttention(2, case.scale, lambda *_: None).prepare(case.meta)
    seen: dict[tuple[int, int, int], list[tuple[int, int]]] = {}
    for seq, g0, g1, row0, rows, k0, k1, _ in plan.items.tolist():
        for g in range(g0, g1):
            for r in range(row0, row0 + rows):
                seen.setdefault((seq, g, r), []).append((k0, k1))
    expected = {(s, g, r) for s, (_, n) in enumerate(shapes) for g in range(2) for r in range(n)}
    assert set(seen) == expected
    for (seq, _, _), ranges in seen.items():
        ranges.sort()
        context = sum(shapes[seq])
        assert ranges[0][0] == 0 and ranges[-1][1] == context
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))


@needs_cpu_kernel
def test_the_kernel_shares_torchs_openmp_runtime() -> None:
    load_cpu_ops()
    with open("/proc/self/maps", encoding="utf-8") as f:
        runtimes = {line.split()[-1] for line in f if "libgomp" in line or "libiomp" in line}
    assert len(runtimes) == 1, runtimes


def test_backend_choice_and_errors_naming_the_option() -> None:
    cpu = torch.device("cpu")
    assert select_attention("reference", 4, 2, 64, cpu).name == "reference"
    expected = "reference" if missing_cpu_features() else "cpu"
    assert select_attention("auto", 4, 2, 64, cpu).name == expected
    # head_dim 12 is not a multiple of 8: auto falls back, a named backend is an error.
    assert select_attention("auto", 4, 2, 12, cpu).name == "reference"
    with pytest.raises(InvalidParameterError, match="multiple of 8") as info:
        select_attention("cpu", 4, 2, 12, cpu)
    assert info.value.param == "attention_backend"
    with pytest.raises(InvalidParameterError) as info:
        select_attention("cpu", 4, 2, 64, torch.device("cuda"))
    assert info.value.param == "attention_backend"


@needs_cpu_kernel
def test_a_failed_build_falls_back_to_the_reference_with_one_warning(tmp_path) -> None:
    model = make_tiny_model(tmp_path / "model")
    code = f"""
import logging
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
from pagedllm import LLM, SamplingParams
out = LLM({str(model)!r}).generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True))
assert len(out[0].outputs[0].token_ids) == 3
"""
    # A compiler that always fails, and an empty kernel cache: the build really fails.
    env = {**os.environ, "CXX": "/bin/false", "PAGEDLLM_CACHE_DIR": str(tmp_path / "cache")}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600
    )
    assert out.returncode == 0, out.stderr
    warnings = [line for line in out.stderr.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1 and "using the reference" in warnings[0], out.stderr
    assert "attention backend: reference" in out.stderr
