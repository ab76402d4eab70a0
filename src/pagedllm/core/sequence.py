"""Sequence and Request: the scheduler's view of the work.

A Request holds the live sequences sampled for one prompt (one, or n for parallel
sampling, or the beams of a beam search). Its live sequences always have the same length,
so one `num_computed_tokens` counter per request says how far their K/V is computed.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pagedllm.sampling_params import BeamSearchParams, SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    token_ids: list[int]
    num_prompt_tokens: int
    index: int = 0  # its place among the request's samples
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    output_text: str = ""  # detokenised output, cut at a stop string

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass(eq=False)
class Request:
    request_id: str
    seqs: list[Sequence]
    num_seq_slots: int = 1  # sequences it may grow to (n, best_of or the beam width)
    reserve_tokens: int = 0  # tokens reserved at admission (contiguous baselines only)
    params: SamplingParams | BeamSearchParams = field(default_factory=SamplingParams)
    arrival_time: float = 0.0
    prompt: str | None = None
    first_token_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at admission
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    finished_seqs: list[Sequence] = field(default_factory=list)
    # Tokens proposed for its one sequence by speculative decoding, for the next step to
    # check (set before each step, taken by the scheduler; empty: none).
    draft_token_ids: list[int] = field(default_factory=list)
    # Slots past its tokens (and proposals) that a step computing up to its last token
    # also claims, from free blocks only, for a draft model to write the proposals it
    # draws after that step (set by the engine; 0: none).
    num_lookahead_tokens: int = 0
    # With SamplingParams.prompt_logprobs: per prompt token, its log-probability and the
    # most likely tokens at its position (None for the first, which nothing predicts),
    # filled chunk by chunk as the prompt is computed.
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    # The LoRA adapter it runs under (0: the base model), where the runner reads it, and
    # how many pool pages it takes (pinned while the request runs).
    lora_id: int = 0
    lora_path: str | None = None
    lora_pages: int = 0

    @property
    def num_tokens(self) -> int:
        return self.seqs[0].num_tokens

    @property
    def computes_prompt_logprobs(self) -> bool:
        """Whether prompt tokens still lack their log-probabilities: the prompt is then
        computed whole, not taken from the prefix cache."""
        return self.wants_prompt_logprobs and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether its params ask for the prompt's log-probabilities."""
        return isinstance(self.params, SamplingParams) and self.params.prompt_logprobs is not None

    def __post_init__(self) -> None:
        # The first sequence: it holds the prompt, whatever becomes of the samples.
        self.prompt_seq = self.seqs[0]
        # Copied once: every output that carries the prompt hands out this same list.
        self.prompt_token_ids = self.prompt_seq.token_ids[: self.prompt_seq.num_prompt_tokens]
        if self.wants_prompt_logprobs and not self.prompt_logprobs:
            self.prompt_logprobs = [None]
