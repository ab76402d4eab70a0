"""The server's request limits, their defaults and their one check: shared by create_app
and `pagedllm serve`, which checks them before loading a model (this module imports no
FastAPI, so `pagedllm --help` stays fast)."""

from __future__ import annotations

DEFAULT_MAX_REQUEST_BYTES = 1 << 20
DEFAULT_BODY_TIMEOUT_S = 30.0
# Prompts in one /v1/completions batch. vLLM takes any number (each prompt is a request of
# its own); a cap keeps one request from filling the queue by itself. Each prompt still
# counts against --max-waiting.
DEFAULT_MAX_PROMPTS_PER_REQUEST = 256


def check_limits(
    max_request_bytes: int,
    body_timeout: float,
    max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST,
) -> None:
    """ValueError naming the field if a limit cannot work."""
    if max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes}")
    if not body_timeout > 0:  # also refuses nan
        raise ValueError(f"body_timeout must be > 0 seconds, got {body_timeout}")
    if max_prompts_per_request < 1:
        raise ValueError(f"max_prompts_per_request must be >= 1, got {max_prompts_per_request}")
