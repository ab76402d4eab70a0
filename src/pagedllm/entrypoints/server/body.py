"""Reading a request body by hand, so that its checks run in a fixed order: size (413),
arrival within the body timeout (408), JSON (400), fields (400), model name (404).

`BodyReader` reads the bytes under both limits, `parse_json` turns them into a JSON
object, and `RequestReader` does both and validates the result against a request model.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Collection, Sequence
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from pagedllm.entrypoints.server.errors import APIError, client_closed, from_validation_error

M = TypeVar("M", bound=BaseModel)


class BodyReader:
    """The whole body of a request, at most `max_bytes` long, within `timeout` seconds."""

    def __init__(self, max_bytes: int, timeout: float) -> None:
        self.max_bytes = max_bytes
        self.timeout = timeout

    async def read(self, request: Request) -> bytes:
        length = request.headers.get("content-length", "")
        if length.isascii() and length.isdigit() and int(length) > self.max_bytes:
            raise too_large(int(length), self.max_bytes)
        try:
            # A client that sends less than its Content-Length (or trickles) would hold
            # the connection and this handler forever.
            return await asyncio.wait_for(self._read(request), self.timeout)
        except asyncio.TimeoutError:
            raise APIError(
                408,
                f"the request body did not arrive within {self.timeout:g} s",
                code="request_timeout",
                headers={"Connection": "close"},  # the rest of the body may still come
            ) from None
        except ClientDisconnect:
            raise client_closed() from None

    async def _read(self, request: Request) -> bytes:
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_bytes:
                raise too_large(None, self.max_bytes)
        return bytes(body)


def parse_json(body: bytes) -> dict[str, Any]:
    """The body as a JSON object; 400 `invalid_json` if it is not one."""
    try:
        data: Any = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(
            400, f"the request body is not valid JSON: {exc}", code="invalid_json"
        ) from None
    except RecursionError:  # json's C decoder stops at the interpreter's depth limit
        raise APIError(
            400, "the request body is not valid JSON: it nests too deeply", code="invalid_json"
        ) from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    return data


class RequestReader:
    """A request body as a validated request model, for a server of the models `names`
    (the base model under each of its names, and its LoRA adapters: a live collection,
    as adapters are loaded and unloaded)."""

    def __init__(self, body: BodyReader, names: Collection[str]) -> None:
        self.body = body
        self.names = names

    async def read(self, request: Request, model: type[M]) -> M:
        data = parse_json(await self.body.read(request))
        try:
            parsed = model.model_validate(data)
        except ValidationError as exc:
            raise from_validation_error(exc) from None
        requested = getattr(parsed, "model", None)
        if requested is not None and requested not in self.names:
            raise model_not_found(requested, list(self.names))
        return parsed


def model_not_found(requested: str, names: Sequence[str]) -> APIError:
    served = ", ".join(f"'{n}'" for n in names)
    return APIError(
        404,
        f"the model '{requested}' does not exist; this server serves {served}",
        param="model",
        code="model_not_found",
    )


def too_large(size: int | None, limit: int) -> APIError:
    what = f"the request body ({size} bytes)" if size is not None else "the request body"
    return APIError(
        413,
        f"{what} exceeds the limit of {limit} bytes",
        code="request_too_large",
        headers={"Connection": "close"},  # the rest of the body is not read
    )
