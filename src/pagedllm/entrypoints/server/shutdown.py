"""Graceful shutdown with a limit, for `pagedllm serve`: uvicorn's Server, which on SIGTERM
or SIGINT closes its listening socket at once (a new connection is refused) and then
waits for the open connections, with the engine told what to do meanwhile.

At the signal the engine admits no new request (one that was already being read gets a
503 `server_shutting_down`); running requests go on for up to `shutdown_timeout`
seconds. At the limit each one still running ends with EngineStoppedError: a stream gets
an error event (503 `server_shutting_down`) and `data: [DONE]`, a request that waits for
its whole answer a 503 response, and their KV blocks go back to the pool. Uvicorn's own
limit, CLOSE_GRACE_S later, cancels whatever still holds a connection (a client that
stopped reading, the KV view's live feed); then the app's lifespan stops the engine and
the process exits. A second Ctrl-C exits at once, as in uvicorn.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import uvicorn

from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.entrypoints.server.limits import check_shutdown_timeout

# After the limit: time for the ended requests' error events to reach their clients.
CLOSE_GRACE_S = 2.0


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine: AsyncLLMEngine, shutdown_timeout: float):
        check_shutdown_timeout(shutdown_timeout)
        super().__init__(config)
        self.engine = engine
        self.shutdown_timeout = shutdown_timeout

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.engine.drain()
        limit = asyncio.get_running_loop().call_later(
            self.shutdown_timeout,
            self.engine.end_unfinished,
            f"the server is shutting down: the request was ended after the shutdown "
            f"timeout of {self.shutdown_timeout:g} s",
        )
        try:
            await super().shutdown(sockets)
        finally:
            limit.cancel()


def serve(app: Any, shutdown_timeout: float, **config: Any) -> None:
    """Run `app` (create_app's, over an AsyncLLMEngine) until SIGTERM or SIGINT, then shut
    down as above; `config`: uvicorn.Config's options (host, port, log_level)."""
    timeout = shutdown_timeout + CLOSE_GRACE_S
    server_config = uvicorn.Config(app, timeout_graceful_shutdown=timeout, **config)
    DrainingServer(server_config, app.state.engine, shutdown_timeout).run()
