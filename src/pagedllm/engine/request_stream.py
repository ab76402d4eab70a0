"""RequestStream: the outputs of requests submitted together, as one async iterator.

The engine's thread hands each output to the consumer's event loop (`put_threadsafe`, or
`deliver` for a step's batch of outputs of one loop at once); leaving the stream early
aborts what has not finished.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from pagedllm.engine.outputs import RequestOutput


class RequestStream:
    """The outputs of one or more requests submitted together (e.g. the prompts of one
    HTTP request), as one async iterator of their RequestOutputs in arrival order; each
    output names its request. It ends when every request has finished. Leaving it early
    (cancellation, `async with` exit, `abort()`; a bare `break` is not seen) or a failure
    of any of them aborts them all and frees their blocks."""

    def __init__(self, abort: Callable[[str], None], request_ids: Sequence[str]) -> None:
        self.request_ids = tuple(request_ids)
        self._abort = abort  # the engine's: safe from any thread
        self.loop = asyncio.get_running_loop()  # the consumer's
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._unfinished = set(self.request_ids)

    @property
    def request_id(self) -> str:
        return self.request_ids[0]

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def put_threadsafe(self, item: RequestOutput | BaseException) -> None:
        """From the engine's thread: `item` into the stream, on the consumer's loop."""
        self.loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._unfinished:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except asyncio.CancelledError:
            self.abort()
            raise
        if isinstance(item, BaseException):
            self.abort()  # the other requests of the group cannot be answered either
            raise item
        if item.finished:
            self._unfinished.discard(item.request_id)
        return item

    def abort(self) -> None:
        """Abort every request of the stream that has not finished."""
        for request_id in self._unfinished:
            self._abort(request_id)
        self._unfinished.clear()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.abort()


def deliver(batch: list[tuple[RequestStream, RequestOutput]]) -> None:
    """On the consumer's loop: each output into its stream's queue."""
    for stream, out in batch:
        stream._queue.put_nowait(out)
