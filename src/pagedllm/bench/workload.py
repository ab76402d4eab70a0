"""Seeded benchmark workloads: token-id prompts with exact output lengths.

Three shapes: `fixed` (every request the same), `uniform` (lengths uniform in ranges) and
`sharegpt` (long-tailed, shaped like ShareGPT conversations). Prompts are random token
ids from the vocabulary, and each request generates exactly `output_len` tokens
(`ignore_eos=True, max_tokens=output_len`), so `reserve-oracle` knows the true length and
every system computes the same tokens. Same spec and seed -> same requests.

The ShareGPT shape: the vLLM paper reports ShareGPT means of 161 prompt and 338 output
tokens with long tails. We draw both from log-normals with those means times `scale`
(default 0.5, i.e. about 80 and 170 tokens) so that a suite fits a 2-core CPU:
prompt ~ LogNormal(mu=ln(161 * scale) - 0.5, sigma=1.0), output ~ LogNormal(mu=ln(338 *
scale) - 0.32, sigma=0.8); then prompts are clipped to [4, max_model_len // 2] and outputs
to [4, max_model_len - prompt], so prompt + output never exceeds the context.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

WORKLOADS = ("sharegpt", "fixed", "uniform")
SHAREGPT_PROMPT_MEAN = 161.0
SHAREGPT_OUTPUT_MEAN = 338.0
SHAREGPT_PROMPT_SIGMA = 1.0
SHAREGPT_OUTPUT_SIGMA = 0.8
MIN_LEN = 4


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: tuple[int, ...]
    output_len: int
    arrival_time: float = 0.0  # seconds after the start (0 for offline runs)

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
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {self.num_prompts}")
        if self.prompt_len < 1 or self.output_len < 1:
            raise ValueError("prompt_len and output_len must be >= 1")
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
    prompts = rng.lognormal(mu_p, SHAREGPT_PROMPT_SIGMA, n)
    outputs = rng.lognormal(mu_o, SHAREGPT_OUTPUT_SIGMA, n)
    pairs = []
    for p, o in zip(prompts, outputs, strict=True):
        p_len = int(np.clip(round(p), MIN_LEN, max_model_len // 2))
        o_len = int(np.clip(round(o), MIN_LEN, max_model_len - p_len))
        pairs.append((p_len, o_len))
    return pairs


def make_workload(spec: WorkloadSpec, vocab_size: int, max_model_len: int) -> list[BenchRequest]:
    """The spec's requests; raises ValueError if a fixed or uniform request cannot fit."""
    rng = np.random.default_rng(spec.seed)
    n = spec.num_prompts
    if spec.kind == "sharegpt":
        lengths = sharegpt_lengths(n, rng, max_model_len, spec.scale)
    elif spec.kind == "fixed":
        lengths = [(spec.prompt_len, spec.output_len)] * n
    else:
        (plo, phi), (olo, ohi) = spec.prompt_range, spec.output_range
        p = rng.integers(plo, phi + 1, n)
        o = rng.integers(olo, ohi + 1, n)
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
    """Mean / max prompt and output lengths, for the benches' headers."""
    p = np.array([r.prompt_len for r in requests])
    o = np.array([r.output_len for r in requests])
    return {
        "num_requests": len(requests),
        "prompt_mean": round(float(p.mean()), 1),
        "prompt_max": int(p.max()),
        "output_mean": round(float(o.mean()), 1),
        "output_max": int(o.max()),
        "prompt_tokens": int(p.sum()),
        "output_tokens": int(o.sum()),
    }
