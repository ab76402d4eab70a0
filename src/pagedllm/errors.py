"""Typed errors shared by every layer.

`InvalidParameterError` names the parameter that was wrong (`param`) and the kind of
problem (`code`), so that callers such as the HTTP server map it to a response without
reading its message. The others say what failed: loading a model (`ModelLoadError`), a
request (`RequestFailedError`; `EngineStoppedError` when the engine shuts down), the
engine's admission (`EngineOverloadedError`), the block pool (`NoFreeBlocksError`), the
compiled kernels (`KernelUnavailableError`), a tensor-parallel group
(`TensorParallelError`), a structured-output grammar that rejected a drawn token
(`GrammarError`), a model that would not fit in memory (`InsufficientMemoryError`,
raised before it loads). Every error type of the engine lives here; the HTTP server's
`APIError` is a response, not an error of the engine. Plain Python: every layer may
import it.
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

    def __reduce__(self) -> tuple[type, tuple[str, str, str]]:
        # Rebuilt whole when pickled (a Ray replica's error reaching the ingress).
        return (type(self), (self.param, str(self), self.code))


class RequestFailedError(RuntimeError):
    """The engine failed while running this request (or stopped before it finished).
    Other requests are not affected."""


class EngineStoppedError(RequestFailedError):
    """The engine is shutting down: it ended this request before it finished, or refused
    it as new (HTTP 503)."""


class EngineOverloadedError(RuntimeError):
    """Too many requests are already waiting: retry later (HTTP 503). `retry_after_s`,
    when known, is how long until there is room."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def __reduce__(self) -> tuple[type, tuple[str, float | None]]:
        return (type(self), (str(self), self.retry_after_s))


class NoFreeBlocksError(RuntimeError):
    """The pool has fewer free blocks than were asked for; nothing was allocated."""


class ModelLoadError(ValueError):
    """A model path, config, checkpoint or tokenizer could not be loaded; the message is
    one clear line (missing path, bad checkpoint, unsupported architecture or tensor)."""


class KernelUnavailableError(RuntimeError):
    """The compiled kernels cannot be used here; the message says why."""


class TensorParallelError(RuntimeError):
    """The tensor-parallel group failed (a rank died, hung or raised)."""


class GrammarError(RuntimeError):
    """A request's grammar rejected the token drawn for it, or its matcher failed; the
    request fails alone."""


class InsufficientMemoryError(InvalidParameterError):
    """The model, its KV pool and working buffers would need more memory than the machine
    has available; raised before any weight loads. `param` names what to change
    ("kv_cache_memory" when the model fits without its KV pool, else "model")."""
