"""EngineReplica: one engine (an AsyncLLMEngine over its own model copy) as a Ray Serve
deployment's replica.

The ingress calls `generate` through a streaming handle: it adds the requests of one
HTTP request (token ids, already templated and tokenized by the ingress), yields None
once they are queued (so that a bad request or a full backlog fails the call before any
output), then every RequestOutput, the last of each request with the engine's snapshot
(the ingress's /metrics add up the replicas' latest). Cancelling the call (a client that
left) aborts them all. `record_routing_stats` tells the prefix-aware router which blocks
this replica's prefix cache holds and how busy it is.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.engine.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.outputs import RequestOutput
from pagedllm.engine.snapshot import EngineSnapshot
from pagedllm.lora import LoRARequest
from pagedllm.sampling_params import SamplingParams

Requests = Sequence[tuple[str, Sequence[int], SamplingParams]]


class EngineReplica:
    def __init__(self, config: EngineConfig, max_waiting: int | None = None) -> None:
        self.config = config
        # Built on its loop thread, as `pagedllm serve` builds it (one thread for torch).
        self.engine = AsyncLLMEngine.build(lambda: LLMEngine(config), max_waiting=max_waiting)
        self.key = _replica_key()

    async def max_model_len(self) -> int:
        """The context limit, for the ingress's model card."""
        return self.engine.max_model_len

    async def generate(
        self,
        requests: Requests,
        arrival_time: float | None = None,
        grammar_param: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[tuple[RequestOutput, str, EngineSnapshot | None] | None]:
        stream = await self.engine.add_requests(
            list(requests), arrival_time, grammar_param, lora_request
        )
        async with stream:  # leaving early (cancelled by the ingress) aborts them all
            yield None
            async for out in stream:
                yield out, self.key, (self.engine.snapshot if out.finished else None)

    async def check_lora(self, lora_request: LoRARequest) -> None:
        """LLMEngine.check_lora (the ingress checks the --lora-modules adapters as it
        starts: the replicas share the base and the limits, so one replica's word holds)."""
        await self.engine.check_lora(lora_request)

    async def record_routing_stats(self) -> dict[str, Any]:
        """The prefix cache's block hashes and the load, for the router."""
        snap = await self.engine.snapshot_now(cached_hashes=True)
        return {
            "cached": sorted(snap.cached_hashes or ()),
            "running": snap.num_running,
            "waiting": snap.num_waiting,
        }

    def __del__(self) -> None:
        self.engine.shutdown(timeout=5)


def _replica_key() -> str:
    """This replica's id in Ray Serve (a process-local id outside it)."""
    try:
        from ray import serve

        return str(serve.get_replica_context().replica_id.unique_id)
    except Exception:
        return f"local-{id(object())}"
