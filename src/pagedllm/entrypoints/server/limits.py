"""The server's request limits, their defaults and their one check: shared by create_app
and `pagedllm serve`, which checks them before loading a model (this module imports no
FastAPI, so `pagedllm --help` stays fast); and the limit of a graceful shutdown
(shutdown.py)."""

from __future__ import annotations

import math

from pagedllm.validation import check_int

DEFAULT_MAX_REQUEST_BYTES = 1 << 20
DEFAULT_BODY_TIMEOUT_S = 30.0
# Prompts in one /v1/completions batch. vLLM takes any number (each prompt is a request of
# its own); a cap keeps one request from filling the queue by itself. Each prompt still
# counts against --max-waiting.
DEFAULT_MAX_PROMPTS_PER_REQUEST = 256
# Seconds running requests may go on after SIGTERM or SIGINT: a few, well inside an
# orchestrator's grace period (Kubernetes kills 30 s after SIGTERM), so that its kill
# never cuts a stream before the stream's error event.
DEFAULT_SHUTDOWN_TIMEOUT_S = 5.0


def check_shutdown_timeout(shutdown_timeout: float) -> None:
    """ValueError unless a finite number of seconds >= 0."""
    if not 0 <= shutdown_timeout < math.inf:  # also refuses nan
        raise ValueError(
            f"shutdown_timeout must be a finite number of seconds >= 0, got {shutdown_timeout}"
        )


def check_limits(
    max_request_bytes: int,
    body_timeout: float,
    max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST,
) -> None:
    """ValueError naming the field if a limit cannot work."""
    check_int(max_request_bytes, "max_request_bytes", min=1)
    if not body_timeout > 0:  # also refuses nan
        raise ValueError(f"body_timeout must be > 0 seconds, got {body_timeout}")
    check_int(max_prompts_per_request, "max_prompts_per_request", min=1)
