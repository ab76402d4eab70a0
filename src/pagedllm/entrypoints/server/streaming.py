"""Generation plumbing shared by the completion and chat endpoints.

`submit` queues a request (engine errors become OpenAI errors), `collect` waits for the
final output while watching for the client to hang up, `sse_response` streams chunks as
Server-Sent Events, and `DeltaTracker` turns the engine's cumulative outputs into deltas.
Whatever way a request ends early (disconnect, cancellation), it is aborted and its KV
blocks go back to the pool.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pagedllm.engine.async_engine import (
    AsyncLLMEngine,
    EngineOverloadedError,
    RequestFailedError,
    RequestStream,
)
from pagedllm.engine.outputs import CompletionOutput, RequestOutput
from pagedllm.entrypoints.server.errors import APIError
from pagedllm.entrypoints.server.metrics import RequestTracker, ServerMetrics
from pagedllm.sampling_params import SamplingParams

RETRY_AFTER_S = 1


class ClientDisconnected(Exception):
    """The client hung up before the response was ready."""


async def submit(
    engine: AsyncLLMEngine,
    metrics: ServerMetrics,
    request_id: str,
    prompt: str | Sequence[int] | Callable[[], str | Sequence[int]],
    params: SamplingParams,
    arrival: float,
    prompt_field: str,
) -> tuple[RequestStream, RequestTracker]:
    try:
        stream = await engine.add_request(request_id, prompt, params)
    except EngineOverloadedError as exc:
        raise APIError(
            503, str(exc), code="server_overloaded", headers={"Retry-After": str(RETRY_AFTER_S)}
        ) from None
    except ValueError as exc:
        message = str(exc)
        if "max_model_len" in message:
            raise APIError(
                400,
                f"the prompt is too long for the model's context: {message}",
                param=prompt_field,
                code="context_length_exceeded",
            ) from None
        param = prompt_field if "prompt" in message else None
        raise APIError(400, message, param=param) from None
    return stream, metrics.tracker(arrival)


def failure(exc: RequestFailedError) -> APIError:
    return APIError(500, str(exc), code="engine_error", type="server_error")


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def collect(
    request: Request, stream: RequestStream, tracker: RequestTracker
) -> RequestOutput:
    """The request's final output; ClientDisconnected (request aborted) if the client left."""

    async def consume() -> RequestOutput:
        final = None
        async for out in stream:
            tracker.on_output(out)
            final = out
        assert final is not None
        return final

    task = asyncio.ensure_future(consume())
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            stream.abort()
            tracker.finish("abort")
    if task.cancelled():
        raise ClientDisconnected()
    try:
        return task.result()
    except RequestFailedError as exc:
        tracker.finish("error")
        raise failure(exc) from None


class _SSEResponse(StreamingResponse):
    """A StreamingResponse that runs `on_close` however the response ends."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def sse_response(
    stream: RequestStream,
    tracker: RequestTracker,
    chunks_of: Callable[[RequestOutput], Iterable[dict[str, Any]]],
    last_chunks: Callable[[RequestOutput], Iterable[dict[str, Any]]],
) -> StreamingResponse:
    """`data: {chunk}` per output, the final chunks, then `data: [DONE]`."""
    state = {"ended": False}

    async def events() -> AsyncIterator[str]:
        final = None
        try:
            async for out in stream:
                tracker.on_output(out)
                final = out
                for chunk in chunks_of(out):
                    yield f"data: {json.dumps(chunk)}\n\n"
            if final is not None:
                for chunk in last_chunks(final):
                    yield f"data: {json.dumps(chunk)}\n\n"
        except RequestFailedError as exc:
            tracker.finish("error")
            yield f"data: {json.dumps(failure(exc).body())}\n\n"
        state["ended"] = True
        yield "data: [DONE]\n\n"

    def on_close() -> None:
        if not state["ended"]:
            stream.abort()
            tracker.finish("abort")

    return _SSEResponse(events(), on_close)


@dataclass
class Delta:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None


@dataclass
class _Sent:
    text: int = 0
    tokens: int = 0
    finished: bool = False


class DeltaTracker:
    """What each choice gained since the previous output. While a choice runs, the last
    `holdback` characters (longest stop string - 1) are held back: a stop string that
    completes later cuts them from the final text, so they must not have been sent."""

    def __init__(self, params: SamplingParams) -> None:
        stops = params.stop or ()
        self.holdback = max((len(s) for s in stops), default=1) - 1
        self.sent: dict[int, _Sent] = {}

    def deltas(self, out: RequestOutput) -> list[Delta]:
        result = []
        for c in out.outputs:
            sent = self.sent.setdefault(c.index, _Sent())
            if sent.finished:
                continue
            result.append(self._delta(c, sent))
        return result

    def _delta(self, c: CompletionOutput, sent: _Sent) -> Delta:
        done = c.finish_reason is not None
        end = len(c.text) if done else max(sent.text, len(c.text) - self.holdback)
        text = c.text[sent.text : end]
        n = len(c.token_ids)
        lps = c.logprobs[sent.tokens : n] if c.logprobs is not None else None
        delta = Delta(
            c.index, text, c.token_ids[sent.tokens : n], lps, _finish_reason(c.finish_reason)
        )
        sent.text, sent.tokens, sent.finished = end, n, done
        return delta


def _finish_reason(reason: str | None) -> str | None:
    return None if reason is None else ("length" if reason == "length" else "stop")


def usage_of(out: RequestOutput) -> dict[str, int]:
    prompt = len(out.prompt_token_ids)
    completion = sum(len(c.token_ids) for c in out.outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
