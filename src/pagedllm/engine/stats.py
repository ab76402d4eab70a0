"""EngineStats: running figures of an engine, a step listener every engine has.

Counts tokens and steps, and keeps the snapshot of every step as it ran, so a run can
report peak blocks in use, time-averaged utilisation and batch size; with speculative
decoding, how many proposed tokens the model accepted.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.engine.listeners import StepListener
from pagedllm.engine.outputs import RequestOutput
from pagedllm.engine.snapshot import EngineSnapshot


class EngineStats(StepListener):
    def __init__(self) -> None:
        self.steps = 0
        self.tokens_computed = 0  # prompt, decode and recomputed tokens run through the model
        self.peak_used_blocks = 0
        self.peak_running_seqs = 0
        self.last: EngineSnapshot | None = None  # the latest step, as it ran
        self._util_sum = 0.0
        self._running_sum = 0

    def on_step_end(
        self, step: SchedulerOutput, outputs: Sequence[RequestOutput], ran: EngineSnapshot
    ) -> None:
        self.steps += 1
        self.tokens_computed += step.num_batched_tokens
        self.last = ran
        self.peak_used_blocks = max(self.peak_used_blocks, ran.usage.used_blocks)
        self.peak_running_seqs = max(self.peak_running_seqs, ran.num_running_seqs)
        self._util_sum += ran.usage.utilization
        self._running_sum += ran.num_running_seqs

    @property
    def mean_utilization(self) -> float:
        """KV utilisation (tokens stored / slots reserved) averaged over steps."""
        return self._util_sum / self.steps if self.steps else 1.0

    @property
    def mean_running_seqs(self) -> float:
        return self._running_sum / self.steps if self.steps else 0.0

    @property
    def spec_acceptance_rate(self) -> float:
        """Proposed tokens the model accepted / proposed tokens, so far (0 with none)."""
        return self.last.spec_acceptance_rate if self.last is not None else 0.0

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens a speculating sequence gained per checking step, its own included."""
        return self.last.spec_mean_accepted_length if self.last is not None else 0.0
