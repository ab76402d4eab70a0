"""The OpenAI-compatible HTTP server: `create_app(engine, ...)` and `pagedllm serve`."""

from __future__ import annotations

from typing import Any


def create_app(*args: Any, **kwargs: Any) -> Any:
    """See `pagedllm.entrypoints.server.app.create_app` (imported lazily: FastAPI is heavy)."""
    from pagedllm.entrypoints.server.app import create_app as _create_app

    return _create_app(*args, **kwargs)
