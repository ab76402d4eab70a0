"""The KV view's routes: GET /kv (the page), GET /kv/snapshot (JSON), POST /kv/token and
GET /kv/events (Server-Sent Events from entrypoints/server/kv_feed.py).

Access follows the API key. With a key set, /kv/snapshot and /kv/token need
`Authorization: Bearer KEY` (401 in the OpenAI error shape otherwise). A browser's
EventSource cannot send that header, so /kv/events takes either the header or
`?token=T`, where T comes from POST /kv/token (with the header): a token signed by this
server that opens a stream within TOKEN_TTL_S seconds. The key itself never goes in a URL
(URLs land in logs and histories). The page at /kv holds no data: without the key it is
sent with status 401, and asks for the key once (kept in the tab's sessionStorage).
Token text appears only when the server runs with --kv-view-text.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import time
from collections.abc import Callable

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse
from starlette.responses import StreamingResponse

from pagedllm.entrypoints.kv_view.page import content_policy, render
from pagedllm.entrypoints.server.auth import ApiKey, same_bytes, unauthorized
from pagedllm.entrypoints.server.kv_feed import KVFeed

TOKEN_TTL_S = 60
NO_STORE = {"Cache-Control": "no-store"}


class StreamTokens:
    """Short-lived tokens for /kv/events: an expiry time signed with a per-server secret."""

    def __init__(self, ttl: float = TOKEN_TTL_S, clock: Callable[[], float] = time.time) -> None:
        self.ttl = ttl
        self.clock = clock
        self._secret = os.urandom(32)

    def issue(self) -> str:
        expiry = str(int(self.clock() + self.ttl))
        return f"{expiry}.{self._sign(expiry)}"

    def valid(self, token: str) -> bool:
        """Whether `token` is one of ours and unexpired; any text is safe to pass."""
        expiry, _, signature = token.partition(".")
        # ASCII digits only: str.isdigit() also takes '²', which int() then refuses.
        if not re.fullmatch("[0-9]{1,20}", expiry):
            return False
        expected = self._sign(expiry).encode("ascii")
        if not same_bytes(signature.encode("utf-8", errors="replace"), expected):
            return False
        return int(expiry) >= self.clock()

    def _sign(self, expiry: str) -> str:
        return hmac.new(self._secret, b"kv-events:" + expiry.encode(), hashlib.sha256).hexdigest()


def kv_router(feed: KVFeed, api_key: ApiKey) -> APIRouter:
    """The routes over `feed`, behind `api_key` when one is set."""
    router = APIRouter(prefix="/kv", include_in_schema=False)
    tokens = StreamTokens()
    page = render("live")
    page_headers = {**NO_STORE, "Content-Security-Policy": content_policy("live", header=True)}

    @router.get("")
    async def kv_page(request: Request) -> HTMLResponse:
        # The page is only a shell: the data behind it asks for the key.
        status = 200 if api_key.accepts(request) else 401
        return HTMLResponse(page, status_code=status, headers=page_headers)

    @router.get("/snapshot")
    async def kv_snapshot(request: Request) -> JSONResponse:
        api_key(request)
        snapshot, _ = await feed.snapshot()
        return JSONResponse(snapshot, headers=NO_STORE)

    @router.post("/token")
    async def kv_token(request: Request) -> JSONResponse:
        api_key(request)
        token = tokens.issue() if api_key.required else None
        return JSONResponse(
            {"token": token, "expires_in": TOKEN_TTL_S if token else None}, headers=NO_STORE
        )

    @router.get("/events")
    async def kv_events(request: Request) -> StreamingResponse:
        token = request.query_params.get("token")
        if api_key.required and not (token and tokens.valid(token)):
            if token:
                raise unauthorized(
                    "the KV view token is invalid or expired: get a new one with POST /kv/token"
                )
            api_key(request)
        return StreamingResponse(
            feed.stream(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    return router
