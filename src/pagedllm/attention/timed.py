"""TimedAttention: any attention backend, with the seconds spent in it added up.

The supported way to measure attention's share of a step (the benches): the runner wraps
its backend in one when asked (`TorchModelRunner(..., profile_attention=True)`), and the
model calls it like any backend. Planning counts as attention time too. On a GPU each
call waits for the device, so the figure is the work's, not its launch's.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from pagedllm.attention.backends import AttentionBackend
from pagedllm.attention.metadata import AttentionMetadata


class TimedAttention:
    def __init__(self, inner: AttentionBackend) -> None:
        self.inner = inner
        self.name = inner.name
        self.seconds = 0.0

    def _sync(self, device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def prepare(self, meta: AttentionMetadata) -> Any:
        start = time.perf_counter()
        plan = self.inner.prepare(meta)
        self.seconds += time.perf_counter() - start
        return plan

    def __call__(self, query: torch.Tensor, *rest: Any, **options: Any) -> torch.Tensor:
        """The inner backend's call (query, key, value, k_cache, v_cache, plan, window),
        timed."""
        self._sync(query.device)
        start = time.perf_counter()
        out = self.inner(query, *rest, **options)
        self._sync(query.device)
        self.seconds += time.perf_counter() - start
        return out
