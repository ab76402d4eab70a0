"""Seeded benchmark workloads: token-id prompts with exact output lengths (EOS ignored).

Shapes: `fixed`, `uniform` (lengths in ranges) and `sharegpt`: log-normal lengths with
ShareGPT's means (161 prompt, 338 output tokens, per the vLLM paper) times `scale`,
sigma 1.0 and 0.8, clipped so that a prompt takes at most half the context and a request
never exceeds it. Same spec and seed, same requests.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

WORKLOADS = ("sharegpt", "fixed", "uniform")
SHAREGPT_PROMPT_MEAN, SHAREGPT_OUTPUT_MEAN = 161.0, 338.0
SHAREGPT_PROMPT_SIGMA, SHAREGPT_OUTPUT_SIGMA = 1.0, 0.8
MIN_LEN = 4


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: tuple[int, ...]
    output_len: int
    arrival_time: float = 0.0  # seconds (or steps) after the start
    prompt_text: str | None = None  # a dataset's prompt, which a server tokenizes itself

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def total_len(self) -> int:
        return self.prompt_len + self.output_len


@dataclass(frozen=True)
class WorkloadSpec:
    kind: str = "sharegpt"
    num_prompts: int = 32
    seed: int = 0
    prompt_len: int = 128  # fixed
    output_len: int = 128  # fixed
    prompt_range: tuple[int, int] = (32, 256)  # uniform, inclusive
    output_range: tuple[int, int] = (32, 256)  # uniform, inclusive
    scale: float = 0.5  # sharegpt: fraction of ShareGPT's mean lengths

    def __post_init__(self) -> None:
        if self.kind not in WORKLOADS:
            raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}, got {self.kind!r}")
        if min(self.num_prompts, self.prompt_len, self.output_len) < 1:
            raise ValueError("num_prompts, prompt_len and output_len must be >= 1")
        for name in ("prompt_range", "output_range"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be LO:HI with 1 <= LO <= HI, got {lo}:{hi}")
        if not self.scale > 0:
            raise ValueError(f"scale must be > 0, got {self.scale}")


def sharegpt_lengths(
    n: int, rng: np.random.Generator, max_model_len: int, scale: float = 0.5
) -> list[tuple[int, int]]:
    """(prompt_len, output_len) pairs, log-normal and clipped to the context."""
    if max_model_len < 2 * MIN_LEN:
        raise ValueError(f"max_model_len must be >= {2 * MIN_LEN}, got {max_model_len}")
    mu_p = math.log(SHAREGPT_PROMPT_MEAN * scale) - SHAREGPT_PROMPT_SIGMA**2 / 2
    mu_o = math.log(SHAREGPT_OUTPUT_MEAN * scale) - SHAREGPT_OUTPUT_SIGMA**2 / 2
    prompts = rng.lognormal(mu_p, SHAREGPT_PROMPT_SIGMA, n).round()
    outputs = rng.lognormal(mu_o, SHAREGPT_OUTPUT_SIGMA, n).round()
    p_lens = np.clip(prompts, MIN_LEN, max_model_len // 2).astype(int)
    o_lens = np.clip(outputs, MIN_LEN, max_model_len - p_lens).astype(int)
    return [(int(p), int(o)) for p, o in zip(p_lens, o_lens, strict=True)]


def make_workload(spec: WorkloadSpec, vocab_size: int, max_model_len: int) -> list[BenchRequest]:
    """The spec's requests; raises ValueError if a fixed or uniform request cannot fit."""
    rng, n = np.random.default_rng(spec.seed), spec.num_prompts
    if spec.kind == "sharegpt":
        lengths = sharegpt_lengths(n, rng, max_model_len, spec.scale)
    elif spec.kind == "fixed":
        lengths = [(spec.prompt_len, spec.output_len)] * n
    else:
        (plo, phi), (olo, ohi) = spec.prompt_range, spec.output_range
        p, o = rng.integers(plo, phi + 1, n), rng.integers(olo, ohi + 1, n)
        lengths = [(int(a), int(b)) for a, b in zip(p, o, strict=True)]
    longest = max(p + o for p, o in lengths)
    if longest > max_model_len:
        raise ValueError(
            f"the {spec.kind} workload has a request of {longest} tokens; "
            f"max_model_len is {max_model_len}"
        )
    return [
        BenchRequest(tuple(int(t) for t in rng.integers(0, vocab_size, p_len)), o_len)
        for p_len, o_len in lengths
    ]


def with_poisson_arrivals(
    requests: Sequence[BenchRequest], rate: float, seed: int = 0
) -> list[BenchRequest]:
    """The same requests arriving as a Poisson process of `rate` requests/s (inf: all at 0)."""
    if not rate > 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
    if math.isinf(rate):
        return [replace(r, arrival_time=0.0) for r in requests]
    gaps = np.random.default_rng(seed + 1).exponential(1.0 / rate, len(requests))
    times = np.cumsum(gaps) - gaps[0]  # the first request arrives at 0
    return [replace(r, arrival_time=float(t)) for r, t in zip(requests, times, strict=True)]


def summarize(requests: Sequence[BenchRequest]) -> dict[str, float]:
    """Mean / max prompt and output lengths, and token totals, for the benches' headers."""
    figures: dict[str, float] = {"num_requests": len(requests)}
    for name in ("prompt", "output"):
        lens = np.array([getattr(r, f"{name}_len") for r in requests])
        figures |= {f"{name}_mean": round(float(lens.mean()), 1), f"{name}_max": int(lens.max())}
        figures[f"{name}_tokens"] = int(lens.sum())
    return figures
