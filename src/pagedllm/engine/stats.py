"""EngineStats: running figures of an engine, a step listener every engine has.

Counts tokens and steps, and keeps the snapshot of every step as it ran, so a run can
report peak blocks in use, time-averaged utilisation and batch size; with speculative
decoding, how many proposed tokens the model accepted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pagedllm.core.scheduler import SchedulerOutput
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
        self.spec_checks = 0  # sequence-steps that checked proposed tokens
        self.spec_proposed_tokens = 0
        self.spec_accepted_tokens = 0

    def note_speculation(self, step: SchedulerOutput, accepted: Mapping[str, list[int]]) -> None:
        """A step checked the proposals of `step`'s speculating sequences; `accepted`:
        the ones each request kept."""
        for s in step.seqs:
            if s.draft_token_ids and s.request_id in accepted:
                self.spec_checks += 1
                self.spec_proposed_tokens += len(s.draft_token_ids)
                self.spec_accepted_tokens += len(accepted[s.request_id])

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
        """Proposed tokens the model accepted / proposed tokens (0 with none proposed)."""
        if not self.spec_proposed_tokens:
            return 0.0
        return self.spec_accepted_tokens / self.spec_proposed_tokens

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens a speculating sequence gained per step that checked its proposals: the
        accepted ones plus the model's own (vLLM's mean acceptance length; 0 with none)."""
        if not self.spec_checks:
            return 0.0
        return 1 + self.spec_accepted_tokens / self.spec_checks
