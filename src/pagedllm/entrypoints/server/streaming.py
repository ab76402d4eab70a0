"""Generation plumbing shared by the completion and chat endpoints.

`submit` queues the engine requests of one HTTP request (one per prompt) as a
`Generation`, `collect` waits for their final outputs while watching for the client to
hang up, `sse_response` streams chunks as Server-Sent Events, and `choice_deltas` gives the
choices of an output as the response numbers them. A stream's requests ask the engine for
DELTA outputs (what is new at each step, text a stop string could still cut held back), a
whole response's for FINAL_ONLY (one output at the end): each output adds to the
response. Whatever way a request ends early (disconnect, cancellation, a failure), all of
its engine requests are aborted and their KV blocks go back to the pool.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pagedllm.engine.engine_client import EngineClient, OutputStream
from pagedllm.engine.outputs import RequestOutput
from pagedllm.entrypoints.server.errors import APIError, client_closed
from pagedllm.entrypoints.server.metrics import RequestTracker, ServerMetrics
from pagedllm.errors import EngineOverloadedError, EngineStoppedError, RequestFailedError
from pagedllm.lora import LoRARequest
from pagedllm.sampling_params import SamplingParams

RETRY_AFTER_S = 1
logger = logging.getLogger("pagedllm")


@dataclass
class Generation:
    """The engine requests of one HTTP request: one stream for all, a metrics tracker
    for each, each one's position among the request's prompts, and the id the logs give
    the HTTP request."""

    stream: OutputStream
    trackers: dict[str, RequestTracker]
    positions: dict[str, int]
    client_id: str = "-"

    def on_output(self, out: RequestOutput) -> int:
        """Record the output (a delta, or a final output); the position of its prompt."""
        self.trackers[out.request_id].on_output(out)
        return self.positions[out.request_id]

    def usage(self) -> dict[str, Any]:
        """Token counts summed over the prompts. `prompt_tokens_details.cached_tokens`
        (OpenAI's field): the prompt tokens served from the prefix cache when each prompt
        was first admitted (a recomputation after preemption does not change it)."""
        prompt = sum(t.prompt_tokens for t in self.trackers.values())
        completion = sum(t.tokens for t in self.trackers.values())
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {
                "cached_tokens": sum(t.cached_tokens for t in self.trackers.values())
            },
        }

    def end(self, reason: str) -> None:
        """Abort what has not finished and count it ("abort" or "error")."""
        self.stream.abort()
        for tracker in self.trackers.values():
            tracker.finish(reason)  # a no-op for requests that finished


async def submit(
    engine: EngineClient,
    metrics: ServerMetrics,
    request_id: str,
    prompts: Sequence[list[int]],
    params: SamplingParams,
    arrival: float,
    client_id: str = "-",
    grammar_param: str | None = None,
    lora_request: LoRARequest | None = None,
) -> Generation:
    """Queue one engine request per prompt, all or none, under the adapter `lora_request`
    (None: the base), for the HTTP request the logs call `client_id`.
    InvalidParameterError (a bad request; a grammar that cannot be compiled names
    `grammar_param`, the request's field) passes through for the caller to map to its
    fields."""
    ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
    try:
        stream = await engine.add_requests(
            [(rid, prompt, params) for rid, prompt in zip(ids, prompts, strict=True)],
            grammar_param=grammar_param,
            lora_request=lora_request,
        )
    except EngineOverloadedError as exc:
        raise overloaded(exc) from None
    except EngineStoppedError as exc:
        raise shutting_down(exc) from None
    return Generation(
        stream,
        {rid: metrics.tracker(arrival) for rid in ids},
        {rid: i for i, rid in enumerate(ids)},
        client_id,
    )


def overloaded(exc: EngineOverloadedError) -> APIError:
    """The 503 of a request the server has no room for now, with Retry-After: the wait
    the error knows (whole seconds, at least 1), else RETRY_AFTER_S."""
    wait = RETRY_AFTER_S if exc.retry_after_s is None else max(1, math.ceil(exc.retry_after_s))
    return APIError(503, str(exc), code="server_overloaded", headers={"Retry-After": str(wait)})


def shutting_down(exc: EngineStoppedError) -> APIError:
    """The 503 of a request refused, or ended before it finished, by a shutdown."""
    return APIError(503, str(exc), code="server_shutting_down")


def failure(gen: Generation, exc: RequestFailedError) -> APIError:
    """The 500 of a request the engine failed (503 when it was shut down), after
    aborting the rest of it."""
    gen.end("error")
    if isinstance(exc, EngineStoppedError):
        logger.warning("request %s ended by the shutdown: %s", gen.client_id, exc)
        return shutting_down(exc)
    logger.warning("request %s failed in the engine: %s", gen.client_id, exc)
    return APIError(500, str(exc), code="engine_error", type="server_error")


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def collect(request: Request, gen: Generation) -> list[RequestOutput]:
    """The final output of each prompt, in order; the 499 APIError (everything aborted)
    if the client left first."""

    async def consume() -> list[RequestOutput]:
        finals: dict[int, RequestOutput] = {}
        async for out in gen.stream:
            finals[gen.on_output(out)] = out
        return [finals[i] for i in sorted(finals)]

    task = asyncio.ensure_future(consume())
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():  # the client left, or this handler was cancelled
            task.cancel()
            gen.end("abort")
    if not task.done():  # cancelled above: it is still unwinding, without a result
        raise client_closed()
    try:
        return task.result()
    except RequestFailedError as exc:
        raise failure(gen, exc) from None


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


def data_event(chunk: dict[str, Any]) -> str:
    return f"data: {json.dumps(chunk)}\n\n"


def sse_response(
    gen: Generation,
    chunks_of: Callable[[int, RequestOutput], Iterable[dict[str, Any]]],
    last_chunks: Callable[[], Iterable[dict[str, Any]]],
    *,
    first: Iterable[dict[str, Any]] = (),
    event: Callable[[dict[str, Any]], str] = data_event,
    failed: Callable[[APIError], dict[str, Any]] = APIError.body,
    done: str = "data: [DONE]\n\n",
) -> StreamingResponse:
    """The `first` chunks, `data: {chunk}` (or what `event` writes) per output (with its
    prompt's position), the final chunks (once every prompt has ended), then `done`. A
    request the engine fails ends the stream with the chunk `failed` makes of its error."""
    state = {"ended": False}

    async def events() -> AsyncIterator[str]:
        for chunk in first:
            yield event(chunk)
        try:
            async for out in gen.stream:
                for chunk in chunks_of(gen.on_output(out), out):
                    yield event(chunk)
            for chunk in last_chunks():
                yield event(chunk)
        except RequestFailedError as exc:
            yield event(failed(failure(gen, exc)))
        state["ended"] = True
        if done:
            yield done

    def on_close() -> None:
        if not state["ended"]:
            gen.end("abort")

    return _SSEResponse(events(), on_close)


@dataclass
class Delta:
    index: int
    text: str
    token_ids: list[int]
    # per token; None for a prompt's first token (echo), which nothing predicts
    logprobs: list[dict[int, float] | None] | None
    finish_reason: str | None


def choice_deltas(out: RequestOutput, first_index: int = 0) -> list[Delta]:
    """The choices of a DELTA or final output; choice `c.index` of this prompt is choice
    `first_index + c.index` of the response (prompt i of a batch starts at i * n)."""
    return [
        Delta(
            first_index + c.index, c.text, c.token_ids, c.logprobs, _finish_reason(c.finish_reason)
        )
        for c in out.outputs
    ]


def _finish_reason(reason: str | None) -> str | None:
    return None if reason is None else ("length" if reason == "length" else "stop")
