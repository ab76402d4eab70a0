"""RequestOutput and CompletionOutput: what the engine returns, shaped like vLLM's."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    num_preemptions: int = field(default=0)
    # Why the request failed (finish_reason "error"): the engine failed while running it,
    # and only it. None for every request that did not fail.
    error: str | None = None
