"""RequestOutput and CompletionOutput: what the engine returns, shaped like vLLM's.

What an output holds depends on its request's `output_kind` (RequestOutputKind, in
sampling_params.py): everything so far (CUMULATIVE), only what is new since the
request's previous output (DELTA), or everything, once, when the request ends
(FINAL_ONLY).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str  # DELTA: only the new text (and token ids, logprobs)
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
    # Both None in a DELTA output after the request's first: the prompt is sent once.
    prompt: str | None
    prompt_token_ids: list[int] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    num_preemptions: int = field(default=0)
    # Why the request failed (finish_reason "error"): the engine failed while running it,
    # and only it. None for every request that did not fail.
    error: str | None = None
    # With SamplingParams.prompt_logprobs, in the outputs that carry the prompt: per
    # prompt token, None for the first, then a map of token id -> log-probability holding
    # the prompt's token and the most likely ones at its position (vLLM's shape).
    prompt_logprobs: list[dict[int, float] | None] | None = None
