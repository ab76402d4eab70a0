"""StepRows: the tokens one engine step draws (a SampleRow each) and whose they are.

Plain bookkeeping between the engine's row building and its per-request processing:
which rows belong to which sampling request or beam search, and which samples are forked
at their first draw.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from pagedllm.core.sequence import Request, Sequence
from pagedllm.worker.runner import SampledTokens, SampleRow


@dataclass
class StepRows:
    """The tokens a step draws: one SampleRow each, and whose they are."""

    rows: list[SampleRow] = field(default_factory=list)
    # request id -> (request, [(sample, its row)]) for sampling requests...
    samples: dict[str, tuple[Request, list[tuple[Sequence, int]]]] = field(default_factory=dict)
    # ... and for beam searches (a beam's row gives its candidates)
    beams: dict[str, tuple[Request, list[tuple[Sequence, int]]]] = field(default_factory=dict)
    forks: list[tuple[Request, Sequence, Sequence]] = field(default_factory=list)
    # request id -> the row of its one sample that checks proposed tokens
    drafts: dict[str, int] = field(default_factory=dict)


def raise_row_errors(sampled: SampledTokens, rows: Iterable[int]) -> None:
    for i in rows:
        if i in sampled.row_errors:
            raise RuntimeError(f"sampling failed: {sampled.row_errors[i]}")
