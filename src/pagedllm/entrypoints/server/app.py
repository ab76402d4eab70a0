"""create_app(engine, ...): the OpenAI-compatible FastAPI app over one engine.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models (these three
behind the API key when one is set), GET /health, GET /metrics. Request bodies are read
by hand, so the checks run in a fixed order: API key (401), size (413), JSON (400),
fields (400), model name (404), sampling values (400), queue length (503), context (400).
"""

from __future__ import annotations

import hmac
import json
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError

from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.server import protocol as p
from pagedllm.entrypoints.server.errors import (
    APIError,
    from_validation_error,
    install_error_handlers,
)
from pagedllm.entrypoints.server.metrics import ServerMetrics
from pagedllm.entrypoints.server.serving import Serving

DEFAULT_MAX_REQUEST_BYTES = 1 << 20
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
M = TypeVar("M", bound=BaseModel)


def default_model_name(model_path: str | None) -> str:
    if model_path is None:
        return DEFAULT_MODEL_NAME
    name = os.path.basename(os.path.normpath(model_path))
    return name[: -len(".gguf")] if name.lower().endswith(".gguf") else name


def create_app(
    engine: LLMEngine | AsyncLLMEngine,
    *,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_waiting: int | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
) -> FastAPI:
    """The app; the engine loop starts with the app (or at the first request) and stops
    with it. `max_waiting` bounds the waiting queue (HTTP 503 beyond it)."""
    if isinstance(engine, LLMEngine):
        engine = AsyncLLMEngine(engine, max_waiting=max_waiting)
    elif max_waiting is not None:
        engine.max_waiting = max_waiting
    if max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes}")
    async_engine = engine
    llm = async_engine.engine
    name = served_model_name or default_model_name(llm.config.model)
    metrics = ServerMetrics(async_engine)
    serving = Serving(async_engine, metrics, name)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        try:
            yield
        finally:
            async_engine.shutdown()

    app = FastAPI(title="pagedllm", lifespan=lifespan)
    app.state.engine = async_engine
    app.state.metrics = metrics
    app.state.model_name = name
    install_error_handlers(app, on_error=lambda e: metrics.rejected.labels(status=e.status).inc())

    def check_api_key(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        ok = scheme.lower() == "bearer" and hmac.compare_digest(
            token.strip().encode(), api_key.encode()
        )
        if not ok:
            raise APIError(
                401,
                "missing or invalid API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )

    async def read_request(request: Request, model: type[M]) -> M:
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > max_request_bytes:
            raise _too_large(int(length), max_request_bytes)
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_request_bytes:
                raise _too_large(None, max_request_bytes)
        try:
            data: Any = json.loads(body)
        except (ValueError, UnicodeDecodeError) as exc:
            raise APIError(
                400, f"the request body is not valid JSON: {exc}", code="invalid_json"
            ) from None
        if not isinstance(data, dict):
            raise APIError(400, "the request body must be a JSON object", code="invalid_json")
        try:
            parsed = model.model_validate(data)
        except ValidationError as exc:
            raise from_validation_error(exc) from None
        requested = getattr(parsed, "model", None)
        if requested is not None and requested != name:
            raise APIError(
                404,
                f"the model '{requested}' does not exist; this server serves '{name}'",
                param="model",
                code="model_not_found",
            )
        return parsed

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        return await serving.completions(await read_request(request, p.CompletionRequest), request)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serving.chat(await read_request(request, p.ChatCompletionRequest), request)

    @v1.get("/models")
    async def models() -> JSONResponse:
        card = p.ModelCard(id=name, max_model_len=llm.max_model_len)
        return JSONResponse(p.dump(p.ModelList(data=[card])))

    app.include_router(v1)

    @app.get("/health")
    async def health() -> JSONResponse:
        if not async_engine.healthy:
            raise APIError(503, "the engine loop has stopped", code="engine_dead")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


def _too_large(size: int | None, limit: int) -> APIError:
    what = f"the request body ({size} bytes)" if size is not None else "the request body"
    return APIError(413, f"{what} exceeds the limit of {limit} bytes", code="request_too_large")
