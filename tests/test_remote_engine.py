"""RemoteEngine over a stand-in deployment handle (no Ray cluster): a request that finds
its replica dead before it was queued is sent again, up to SEND_ATTEMPTS replicas, then
refused with EngineOverloadedError (the server's 503); a replica's own error is raised as
it is, without a resend; a replica that dies while it streams ends the stream with
RequestFailedError (the server's 500 or SSE error event)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("ray.serve")

from ray.exceptions import ActorDiedError, RayTaskError

from pagedllm.engine.config import EngineConfig
from pagedllm.entrypoints.ray_serve import remote_engine
from pagedllm.entrypoints.ray_serve.remote_engine import RemoteEngine
from pagedllm.errors import EngineOverloadedError, InvalidParameterError, RequestFailedError
from pagedllm.sampling_params import SamplingParams

REQUESTS = [("r0", [1, 2, 3], SamplingParams(max_tokens=2))]


class StandInCall:
    """One streaming `generate` call: yields or raises each of `steps` in turn."""

    def __init__(self, steps: list[Any]) -> None:
        self.steps: Iterator[Any] = iter(steps)
        self.cancelled = False

    async def __anext__(self) -> Any:
        step = next(self.steps, StopAsyncIteration())
        if isinstance(step, BaseException):
            raise step
        return step

    def cancel(self) -> None:
        self.cancelled = True


class StandInHandle:
    """`handle.options(stream=True).generate.remote(...)`, one scripted call per send."""

    def __init__(self, calls: list[StandInCall]) -> None:
        self.calls = calls
        self.sent = 0

    def options(self, **_: Any) -> StandInHandle:
        return self

    @property
    def generate(self) -> StandInHandle:
        return self

    def remote(
        self,
        requests: list,
        arrival_time: float | None,
        grammar_param: str | None,
        lora_request: Any = None,
    ) -> StandInCall:
        self.sent += 1
        return self.calls[self.sent - 1]


@pytest.fixture(autouse=True)
def no_resend_delay(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(remote_engine, "RESEND_DELAY_S", 0.0)


def engine(calls: list[StandInCall]) -> tuple[RemoteEngine, StandInHandle]:
    handle = StandInHandle(calls)
    return RemoteEngine(handle, EngineConfig(), None, 0), handle


def test_a_request_that_found_a_dead_replica_is_sent_again() -> None:
    remote, handle = engine([StandInCall([ActorDiedError()]), StandInCall([None])])
    stream = asyncio.run(remote.add_requests(REQUESTS))
    assert handle.sent == 2 and stream.request_ids == ("r0",)


def test_no_live_replica_is_a_503_to_retry() -> None:
    calls = [StandInCall([ActorDiedError()]) for _ in range(remote_engine.SEND_ATTEMPTS)]
    remote, handle = engine(calls)
    with pytest.raises(EngineOverloadedError, match="retry later"):
        asyncio.run(remote.add_requests(REQUESTS))
    assert handle.sent == remote_engine.SEND_ATTEMPTS


def test_the_replicas_own_error_is_not_resent() -> None:
    refused = InvalidParameterError("max_tokens", "too many")
    wrapped = RayTaskError("generate", "traceback", refused)
    remote, handle = engine([StandInCall([wrapped]), StandInCall([None])])
    with pytest.raises(InvalidParameterError) as info:
        asyncio.run(remote.add_requests(REQUESTS))
    assert (info.value.param, handle.sent) == ("max_tokens", 1)


def test_a_replica_dying_mid_stream_fails_the_stream() -> None:
    call = StandInCall([None, ActorDiedError()])
    remote, _ = engine([call])

    async def consume() -> None:
        stream = await remote.add_requests(REQUESTS)
        async for _ in stream:
            pass

    with pytest.raises(RequestFailedError, match="engine replica running this request stopped"):
        asyncio.run(consume())
    assert call.cancelled  # the call is let go of
