"""The load generators' HTTP client: streamed OpenAI completions read as server-sent events.

It runs on aiohttp, whose HTTP parser is compiled: on the same two cores as the server it
measures, a load generator's own CPU per streamed token slows the server down, and httpx
(pure Python line decoding) took about three times aiohttp's (docs/serving.md).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp

# What a failed request raises here; the load generators record it as that request's error.
REQUEST_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError)


class ServerStatusError(aiohttp.ClientError):
    """The server answered with a status other than 200."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}: {body[:200]!r}")


class LoadClient:
    """Requests to one OpenAI-compatible server over a pool of kept-alive connections."""

    def __init__(self, session: aiohttp.ClientSession, url: str) -> None:
        self._session = session
        self._url = url.rstrip("/")

    async def first_model(self) -> str:
        """The id of the first model the server lists."""
        async with self._session.get(f"{self._url}/v1/models") as r:
            r.raise_for_status()
            return (await r.json())["data"][0]["id"]

    async def post(self, path: str, body: dict[str, Any]) -> None:
        """A request whose answer is not read (a warm-up)."""
        async with self._session.post(f"{self._url}{path}", json=body) as r:
            await r.read()

    async def stream(self, path: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """The JSON of each `data:` event of a streamed answer, as it comes, up to `[DONE]`
        (callers that may stop early close it: `contextlib.aclosing`)."""
        async with self._session.post(f"{self._url}{path}", json=body) as r:
            if r.status != 200:
                raise ServerStatusError(r.status, await r.read())
            async for line in r.content:
                if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                    yield json.loads(line[6:])


@asynccontextmanager
async def load_client(
    url: str, api_key: str | None, connections: int, timeout: float
) -> AsyncIterator[LoadClient]:
    """A client of the server at `url` with up to `connections` open at once; a request
    fails when its connection takes 30 s to open or its answer pauses for `timeout` s."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    session = aiohttp.ClientSession(
        headers=headers,
        connector=aiohttp.TCPConnector(limit=connections),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=timeout),
        read_bufsize=1 << 20,  # an event's line may be long (logprobs, a whole answer)
    )
    async with session:
        yield LoadClient(session, url)
