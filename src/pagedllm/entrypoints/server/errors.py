"""Errors in the OpenAI format: `{"error": {"message", "type", "param", "code"}}`.

`APIError` carries an HTTP status; the handlers installed by `install_error_handlers`
turn it, FastAPI's own errors and any unexpected exception into that format. A stack
trace never reaches the client (unexpected errors are logged on the server).
`from_invalid_param` maps the engine's typed InvalidParameterError to a 400 naming the
request's own field, without reading the message.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm.entrypoints.server.request_id import request_id, response_headers
from pagedllm.errors import InvalidParameterError

logger = logging.getLogger("pagedllm")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    499: "invalid_request_error",  # the client closed the request (nginx's code)
    503: "service_unavailable_error",
}
# Routing errors (raised by Starlette, not by this server's code) get codes too.
_ROUTING_CODES = {404: "not_found", 405: "method_not_allowed"}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "server_error")
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return ASCIIJSONResponse(self.body(), status_code=self.status, headers=self.headers)


class ASCIIJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped: a message that quotes the client's input may hold a
    lone surrogate, which cannot be encoded as UTF-8 (the default) but can be escaped."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def client_closed() -> APIError:
    """The client hung up before its response was ready (nginx's 499: never sent, but
    counted in the metrics)."""
    return APIError(499, "client closed the request", code="client_closed")


def from_invalid_param(
    exc: InvalidParameterError, fields: Mapping[str, str] | None = None
) -> APIError:
    """400 for a typed engine error: `fields` renames engine parameters to the request's
    fields (e.g. chat's "prompt" is "messages"); the code says what kind of problem."""
    param = (fields or {}).get(exc.param, exc.param)
    return APIError(400, str(exc), param=param, code=exc.code)


def from_validation_error(exc: ValidationError | RequestValidationError) -> APIError:
    """400 naming the first offending field, e.g. `max_tokens: Input should be ...`."""
    err = exc.errors()[0]
    parts = [str(p) for p in err.get("loc", ()) if not _is_union_tag(p)]
    if parts and parts[0] == "body":  # FastAPI prefixes body fields
        parts = parts[1:]
    field = ".".join(parts)
    msg = err.get("msg", "invalid value")
    if err.get("type") == "missing":
        message = f"missing required field '{field}'"
    elif field:
        message = f"invalid field '{field}': {msg}"
    else:
        message = f"invalid request body: {msg}"
    return APIError(400, message, param=parts[0] if parts else None, code="invalid_field")


def _is_union_tag(part: object) -> bool:
    # pydantic names the member of a union it tried: ('prompt', 'list[int]', 1)
    return isinstance(part, str) and (
        "[" in part or part in ("str", "int", "float", "bool", "list", "dict", "none")
    )


def install_error_handlers(
    app: FastAPI, on_error: Callable[[APIError], None] | None = None
) -> None:
    """Answer every error in the OpenAI format; `on_error` sees each APIError (metrics)."""

    def respond(request: Request, exc: APIError) -> JSONResponse:
        logger.info(
            "request %s: %s %s answered %d (%s)",
            request_id(request),
            request.method,
            request.url.path,
            exc.status,
            exc.code,
        )
        if on_error is not None:
            on_error(exc)
        return exc.response()

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return respond(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return respond(request, from_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return respond(request, routing_error(request, exc))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception(
            "request %s: unexpected error serving %s", request_id(request), request.url.path
        )
        # Answered outside the request id middleware: its headers are added here.
        error = APIError(
            500, "internal server error", code="internal_error", headers=response_headers(request)
        )
        return respond(request, error)


def routing_error(request: Request, exc: StarletteHTTPException) -> APIError:
    """404 for a path the server does not have, 405 for a method a path does not take."""
    status = exc.status_code
    where = f"{request.method} {request.url.path}"
    if status == 404:
        message = f"there is no {where} on this server"
    elif status == 405:
        allowed = (exc.headers or {}).get("Allow")
        message = f"{where} is not allowed" + (f"; use {allowed}" if allowed else "")
    else:
        message = str(exc.detail)
    return APIError(status, message, code=_ROUTING_CODES.get(status), headers=exc.headers)
