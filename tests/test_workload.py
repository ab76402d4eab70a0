"""The benchmark workload generator: determinism, length bounds and distribution shape."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pagedllm.bench.workload import (
    MIN_LEN,
    SHAREGPT_OUTPUT_MEAN,
    SHAREGPT_PROMPT_MEAN,
    BenchRequest,
    WorkloadSpec,
    make_workload,
    sharegpt_lengths,
    summarize,
    with_poisson_arrivals,
)

VOCAB = 1000


@pytest.mark.parametrize("kind", ["sharegpt", "fixed", "uniform"])
def test_same_seed_same_requests(kind: str) -> None:
    spec = WorkloadSpec(kind=kind, num_prompts=20, seed=7)
    assert make_workload(spec, VOCAB, 2048) == make_workload(spec, VOCAB, 2048)
    other = make_workload(WorkloadSpec(kind=kind, num_prompts=20, seed=8), VOCAB, 2048)
    assert other != make_workload(spec, VOCAB, 2048)


def test_fixed_and_uniform_lengths() -> None:
    fixed = make_workload(WorkloadSpec("fixed", 5, prompt_len=9, output_len=3), VOCAB, 64)
    assert [(r.prompt_len, r.output_len) for r in fixed] == [(9, 3)] * 5
    uni = make_workload(
        WorkloadSpec("uniform", 300, prompt_range=(5, 8), output_range=(2, 3)), VOCAB, 64
    )
    assert {r.prompt_len for r in uni} == {5, 6, 7, 8}
    assert {r.output_len for r in uni} == {2, 3}
    assert all(0 <= t < VOCAB for r in uni for t in r.prompt_token_ids)


@pytest.mark.parametrize("max_len", [64, 512, 2048])
def test_sharegpt_bounds(max_len: int) -> None:
    reqs = make_workload(WorkloadSpec("sharegpt", 2000, scale=1.0), VOCAB, max_len)
    for r in reqs:
        assert MIN_LEN <= r.prompt_len <= max_len // 2
        assert r.output_len >= MIN_LEN
        assert r.total_len <= max_len


def test_sharegpt_means_follow_scale_and_tail_is_long() -> None:
    rng = np.random.default_rng(0)
    pairs = np.array(sharegpt_lengths(20000, rng, 1 << 20, scale=0.5))
    p, o = pairs[:, 0], pairs[:, 1]
    assert math.isclose(p.mean(), SHAREGPT_PROMPT_MEAN * 0.5, rel_tol=0.08)
    assert math.isclose(o.mean(), SHAREGPT_OUTPUT_MEAN * 0.5, rel_tol=0.08)
    assert np.median(o) < o.mean()  # right-skewed
    assert np.percentile(o, 99) > 3 * np.median(o)  # a long tail


def test_poisson_arrivals() -> None:
    reqs = [BenchRequest((1, 2), 3)] * 4000
    timed = with_poisson_arrivals(reqs, rate=5.0, seed=1)
    times = [r.arrival_time for r in timed]
    assert times[0] == 0.0 and times == sorted(times)
    assert math.isclose(times[-1] / (len(times) - 1), 1 / 5.0, rel_tol=0.1)
    assert timed == with_poisson_arrivals(reqs, rate=5.0, seed=1)
    assert all(r.arrival_time == 0 for r in with_poisson_arrivals(reqs[:3], math.inf))
    with pytest.raises(ValueError, match="rate"):
        with_poisson_arrivals(reqs, 0.0)


def test_invalid_specs() -> None:
    with pytest.raises(ValueError, match="workload must be"):
        WorkloadSpec(kind="alpaca")
    with pytest.raises(ValueError, match="num_prompts"):
        WorkloadSpec(num_prompts=0)
    with pytest.raises(ValueError, match="prompt_range"):
        WorkloadSpec(prompt_range=(9, 3))
    with pytest.raises(ValueError, match="max_model_len"):
        make_workload(WorkloadSpec("fixed", 1, prompt_len=60, output_len=10), VOCAB, 64)


def test_summarize() -> None:
    s = summarize([BenchRequest((1,) * 4, 6), BenchRequest((1,) * 8, 2)])
    assert s == {
        "num_requests": 2,
        "prompt_mean": 6.0,
        "prompt_max": 8,
        "output_mean": 4.0,
        "output_max": 6,
        "prompt_tokens": 12,
        "output_tokens": 8,
    }
