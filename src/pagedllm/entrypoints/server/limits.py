"""The server's request limits, their defaults and their one check: shared by create_app
and `pagedllm serve`, which checks them before loading a model (this module imports no
FastAPI, so `pagedllm --help` stays fast)."""

from __future__ import annotations

DEFAULT_MAX_REQUEST_BYTES = 1 << 20
DEFAULT_BODY_TIMEOUT_S = 30.0


def check_limits(max_request_bytes: int, body_timeout: float) -> None:
    """ValueError naming the field if a limit cannot work."""
    if max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes}")
    if not body_timeout > 0:  # also refuses nan
        raise ValueError(f"body_timeout must be > 0 seconds, got {body_timeout}")
