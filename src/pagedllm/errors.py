"""Typed errors shared by every layer.

`InvalidParameterError` names the parameter that was wrong (`param`) and the kind of
problem (`code`), so that callers such as the HTTP server map it to a response without
reading its message. The others say what failed: a request (`RequestFailedError`), the
engine's admission (`EngineOverloadedError`), the block pool (`NoFreeBlocksError`).
Plain Python: every layer may import it.
"""

from __future__ import annotations

INVALID_VALUE = "invalid_value"
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
KV_CACHE_EXCEEDED = "kv_cache_exceeded"
UNSUPPORTED = "unsupported_parameter"


class InvalidParameterError(ValueError):
    """A value of parameter `param` that is not allowed; the message gives the range."""

    def __init__(self, param: str, message: str, code: str = INVALID_VALUE) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class RequestFailedError(RuntimeError):
    """The engine failed while running this request (or stopped before it finished).
    Other requests are not affected."""


class EngineOverloadedError(RuntimeError):
    """Too many requests are already waiting: retry later (HTTP 503)."""


class NoFreeBlocksError(RuntimeError):
    """The pool has fewer free blocks than were asked for; nothing was allocated."""
