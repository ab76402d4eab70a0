"""Request ids and the headers every response carries.

`RequestIdMiddleware` (plain ASGI, so streams and disconnects pass through untouched)
takes the client's `X-Request-Id`, or makes one when there is none or it is unusable,
keeps it in `request.state.request_id` for the handlers and the logs, and adds it to
every response, streams included, along with `X-Content-Type-Options: nosniff` and
`X-Frame-Options: DENY`. Errors answered outside it (an unexpected exception) add the
same headers through `response_headers`.
"""

from __future__ import annotations

import re
import uuid

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

MAX_REQUEST_ID = 256
# Visible ASCII and spaces only: the id goes back in a header and into log lines.
_USABLE = re.compile(rb"[\x20-\x7e]{1,%d}" % MAX_REQUEST_ID)
SECURITY_HEADERS = {"X-Content-Type-Options": "nosniff", "X-Frame-Options": "DENY"}


def request_id(request: Request) -> str:
    """The id of this request (the client's X-Request-Id, or one made for it)."""
    return str(getattr(request.state, "request_id", None) or "-")


def response_headers(request: Request) -> dict[str, str]:
    """The headers RequestIdMiddleware adds, for a response sent around it."""
    return {"X-Request-Id": request_id(request), **SECURITY_HEADERS}


class RequestIdMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = dict(scope["headers"]).get(b"x-request-id", b"").strip()
        rid = sent.decode("ascii") if _USABLE.fullmatch(sent) else uuid.uuid4().hex
        # In place: the error handler outside this middleware reads the same dict.
        scope.setdefault("state", {})["request_id"] = rid
        extra = [(b"x-request-id", rid.encode("ascii"))] + [
            (k.lower().encode("ascii"), v.encode("ascii")) for k, v in SECURITY_HEADERS.items()
        ]

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                taken = {k.lower() for k, _ in message.get("headers", [])}
                headers = list(message.get("headers", []))
                headers += [(k, v) for k, v in extra if k not in taken]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)
