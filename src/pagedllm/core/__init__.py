"""Scheduling policy: requests, their sequences, and the continuous-batching scheduler.

Plain Python, no torch: the scheduler speaks to the worker in request ids, token ids
and block ids.
"""

from pagedllm.core.scheduler import Scheduler, SchedulerConfig
from pagedllm.core.scheduler_output import ScheduledSeq, SchedulerOutput
from pagedllm.core.sequence import Request, RequestStatus, Sequence

__all__ = [
    "Request",
    "RequestStatus",
    "ScheduledSeq",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "Sequence",
]
