"""EngineStats: running figures of the engine, updated once per step.

Counts tokens and steps, and samples the KV pool after every step, so a run can report
peak blocks in use, time-averaged utilisation and batch size.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.core.scheduler import Scheduler, SchedulerOutput
from pagedllm.kv.manager import KVCacheManager, KVUsage


@dataclass
class EngineStats:
    steps: int = 0
    tokens_computed: int = 0  # prompt, decode and recomputed tokens run through the model
    peak_used_blocks: int = 0
    peak_running_seqs: int = 0
    last_usage: KVUsage | None = None
    _util_sum: float = 0.0
    _running_sum: int = 0

    def record_step(self, step: SchedulerOutput, scheduler: Scheduler, kv: KVCacheManager) -> None:
        self.steps += 1
        self.tokens_computed += step.num_batched_tokens
        usage = kv.usage()
        self.last_usage = usage
        running = scheduler.num_running_seqs
        self.peak_used_blocks = max(self.peak_used_blocks, usage.used_blocks)
        self.peak_running_seqs = max(self.peak_running_seqs, running)
        self._util_sum += usage.utilization
        self._running_sum += running

    @property
    def mean_utilization(self) -> float:
        """KV utilisation (tokens stored / slots reserved) averaged over steps."""
        return self._util_sum / self.steps if self.steps else 1.0

    @property
    def mean_running_seqs(self) -> float:
        return self._running_sum / self.steps if self.steps else 0.0
