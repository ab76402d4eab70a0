"""RemoteEngine: the EngineClient the OpenAI server (entrypoints/server) runs over, served
by engine replicas behind a Ray Serve handle.

The server's code runs unchanged in the ingress over this object: `add_requests` sends a
request group through the handle (the router picks the replica from the prompt's token
ids), waits until the replica has queued it (so that a 400 or a 503 comes before any
output, as in one process), and returns a RemoteStream with the RequestStream's
interface. The tokenizer is loaded here, for templating and tokenizing off the replicas.
Each replica checks a request and compiles its grammar (off its engine thread) as it
queues it. `snapshot` adds up the replicas' latest snapshots (sent with each finished
request) for /metrics.

A replica that dies (its process killed, its node lost): the requests it was running end
with RequestFailedError (the server's 500, or an error event in a stream); a request sent
to it before it had queued it is sent again, to the replica the router picks next (Ray
Serve drops a dead replica from the set and starts a replacement), and after
`SEND_ATTEMPTS` lost replicas fails with EngineOverloadedError (503, retry later).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Sequence
from typing import Any

from ray.exceptions import RayActorError
from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError

from pagedllm.engine.config import EngineConfig
from pagedllm.engine.engine_client import PromptRequest
from pagedllm.engine.outputs import RequestOutput
from pagedllm.engine.snapshot import EngineSnapshot
from pagedllm.errors import EngineOverloadedError, RequestFailedError
from pagedllm.kv.manager import KVUsage
from pagedllm.lora import LoRARequest

SEND_ATTEMPTS = 3  # replicas a request may find dead before it is refused
RESEND_DELAY_S = 0.2  # for Ray Serve to learn of the dead replica
LOST = (RayActorError, ReplicaUnavailableError, DeploymentUnavailableError)


class RemoteEngine:
    """An EngineClient (engine/engine_client.py) over engine replicas."""

    config: EngineConfig
    tokenizer: Any
    max_model_len: int
    healthy: bool

    def __init__(
        self, handle: Any, config: EngineConfig, tokenizer: Any, max_model_len: int
    ) -> None:
        """`handle`: a DeploymentHandle of EngineReplica; `config`, `max_model_len`: the
        replicas' (each enforces its own limits, max_waiting among them); `tokenizer`:
        loaded in this process, for templating and tokenizing off the replicas."""
        self.handle = handle
        self.config = config
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.healthy = True  # Ray Serve replaces a replica that dies
        self._snapshots: dict[str, EngineSnapshot] = {}

    def start(self) -> None:
        """The replicas run their own loops: nothing to start here."""

    def shutdown(self, timeout: float | None = None) -> None:
        """The replicas stop with their Ray Serve application."""

    @property
    def snapshot(self) -> EngineSnapshot:
        return _sum(self._snapshots.values(), self.config.block_size)

    async def add_requests(
        self,
        requests: Sequence[PromptRequest],
        arrival_time: float | None = None,
        grammar_param: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> RemoteStream:
        """Queue the requests together on one replica, all or none, under the adapter
        `lora_request` (each replica serves every --lora-modules adapter); raises what
        the replica's add_requests raised (InvalidParameterError, EngineOverloadedError)."""
        if not requests:
            raise ValueError("add_requests needs at least one request")
        for attempt in range(SEND_ATTEMPTS):
            calls = self.handle.options(stream=True).generate.remote(
                list(requests), arrival_time, grammar_param, lora_request
            )
            try:
                await calls.__anext__()  # queued on the replica
            except asyncio.CancelledError:
                calls.cancel()
                raise
            except Exception as exc:
                if not replica_lost(exc):
                    raise _cause(exc) from None
                # Nothing ran on the dead replica: sending the request again is safe.
                if attempt + 1 < SEND_ATTEMPTS:
                    await asyncio.sleep(RESEND_DELAY_S * (attempt + 1))
                continue
            return RemoteStream(self, [r[0] for r in requests], calls)
        raise EngineOverloadedError(
            f"no engine replica could take the request ({SEND_ATTEMPTS} were unreachable); "
            "retry later"
        )

    async def check_lora(self, lora_request: LoRARequest) -> None:
        """One replica's LLMEngine.check_lora (they share the base and the limits)."""
        try:
            await self.handle.check_lora.remote(lora_request)
        except Exception as exc:
            raise _cause(exc) from None

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Not served over replicas: a removal must reach every one of them, which a
        handle's call does not (`pagedllm serve --ray` refuses --enable-lora-loading)."""
        raise NotImplementedError("removing a LoRA adapter is not available over Ray Serve")

    def _note(self, replica_key: str, snapshot: EngineSnapshot) -> None:
        self._snapshots[replica_key] = snapshot


class RemoteStream:
    """RequestStream's interface over a replica's streamed outputs."""

    def __init__(self, engine: RemoteEngine, request_ids: Sequence[str], calls: Any) -> None:
        self.request_ids = tuple(request_ids)
        self._engine = engine
        self._calls = calls
        self._unfinished = set(self.request_ids)

    @property
    def request_id(self) -> str:
        return self.request_ids[0]

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._unfinished:
            raise StopAsyncIteration
        try:
            out, replica, snapshot = await self._calls.__anext__()
        except asyncio.CancelledError:
            self.abort()
            raise
        except StopAsyncIteration:
            self._unfinished.clear()
            raise RequestFailedError("the engine replica ended the request early") from None
        except Exception as exc:
            self.abort()
            cause = _cause(exc)
            if isinstance(cause, RequestFailedError):
                raise cause from None
            if replica_lost(exc):
                raise RequestFailedError(
                    "the engine replica running this request stopped (its process died)"
                ) from None
            raise RequestFailedError(f"the engine replica failed: {cause}") from None
        if snapshot is not None:
            self._engine._note(replica, snapshot)
        if out.finished:
            self._unfinished.discard(out.request_id)
        return out

    def abort(self) -> None:
        """Abort every request of the stream that has not finished (cancels the call)."""
        if self._unfinished:
            self._unfinished.clear()
            self._calls.cancel()

    async def __aenter__(self) -> RemoteStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.abort()


def replica_lost(exc: BaseException) -> bool:
    """Whether `exc` says the replica (not the request) failed: its actor died or is
    unreachable, or the deployment has no replica at the moment."""
    return isinstance(exc, LOST) or isinstance(getattr(exc, "cause", None), LOST)


def _cause(exc: Exception) -> Exception:
    """The replica's own exception inside Ray's wrapper, else `exc`."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, Exception) else exc


def _sum(snapshots: Any, block_size: int) -> EngineSnapshot:
    snaps = list(snapshots)
    usage = KVUsage(
        block_size=block_size,
        **{
            f.name: sum(getattr(s.usage, f.name) for s in snaps)
            for f in dataclasses.fields(KVUsage)
            if f.name != "block_size"
        },
    )
    counts = {
        f.name: sum(getattr(s, f.name) for s in snaps)
        for f in dataclasses.fields(EngineSnapshot)
        if f.type in ("int", int)
    }
    return EngineSnapshot(usage=usage, **counts)
