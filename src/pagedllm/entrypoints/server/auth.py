"""The API key check: `ApiKey`, a FastAPI dependency that answers 401 in the OpenAI error
shape unless the request carries `Authorization: Bearer KEY`.

Keys and tokens are compared as UTF-8 bytes in constant time (`same_bytes`): comparing
str values would fail on non-ASCII text (hmac refuses it), and a client's header arrives
as bytes (Starlette decodes it as Latin-1, so encoding it back gives those bytes).
"""

from __future__ import annotations

import hmac

from fastapi import Request

from pagedllm.entrypoints.server.errors import APIError


def same_bytes(given: bytes, expected: bytes) -> bool:
    """`given == expected`, in a time that does not tell how much of it matched."""
    return hmac.compare_digest(given, expected)


class ApiKey:
    """The server's key (None: no key; "" also means no key, as it reads)."""

    def __init__(self, key: str | None) -> None:
        self.key = key or None
        self._expected = self.key.encode("utf-8") if self.key is not None else b""

    @property
    def required(self) -> bool:
        return self.key is not None

    def accepts(self, request: Request) -> bool:
        """Whether the request may pass: no key is set, or its bearer token is the key."""
        if self.key is None:
            return True
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        # Latin-1 is how Starlette decoded the header: this gives back the bytes sent.
        sent = token.strip().encode("latin-1", errors="replace")
        return scheme.lower() == "bearer" and same_bytes(sent, self._expected)

    def __call__(self, request: Request) -> None:
        """The dependency: 401 unless `accepts(request)`."""
        if not self.accepts(request):
            raise unauthorized("missing or invalid API key: send 'Authorization: Bearer <key>'")


def unauthorized(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
