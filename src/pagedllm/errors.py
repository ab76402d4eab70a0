"""Typed errors shared by every layer.

`InvalidParameterError` names the parameter that was wrong (`param`) and the kind of
problem (`code`), so that callers such as the HTTP server map it to a response without
reading its message. `StepFailedError` says which requests a failed engine step was
running, so that only those fail.
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


class StepFailedError(RuntimeError):
    """An engine step raised (that exception is the `__cause__`); `request_ids` are the
    requests it had scheduled."""

    def __init__(self, request_ids: tuple[str, ...], cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.request_ids = request_ids
