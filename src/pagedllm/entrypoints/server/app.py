"""create_app(engine, ...): the OpenAI-compatible FastAPI app over one engine.

Routes: POST /v1/completions, POST /v1/chat/completions, GET|HEAD /v1/models and
GET /v1/models/{id} (all behind the API key when one is set; an empty key is no key),
GET|HEAD /health, GET /metrics, the KV view under /kv unless `kv_view=False` (behind the
key too; see kv_routes.py), and, only with `enable_docs`, /docs, /redoc and /openapi.json
(behind the key too). Request bodies are read by hand, so the checks run in
a fixed order: API key (401), size (413), arrival within `body_timeout` (408), JSON (400),
fields (400), model name (404), unsupported fields and sampling values (400), prompt text
(400), backlog (503), context and KV-pool fit (400). Bad client input is never a 500.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

import pagedllm.entrypoints.server.protocol as p
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.server.errors import (
    APIError,
    client_closed,
    from_validation_error,
    install_error_handlers,
)
from pagedllm.entrypoints.server.kv_feed import KVFeed
from pagedllm.entrypoints.server.kv_routes import kv_router
from pagedllm.entrypoints.server.limits import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_MAX_REQUEST_BYTES,
    check_limits,
)
from pagedllm.entrypoints.server.metrics import ServerMetrics
from pagedllm.entrypoints.server.serving import Serving

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
    body_timeout: float = DEFAULT_BODY_TIMEOUT_S,
    allowed_origins: Sequence[str] = (),
    enable_docs: bool = False,
    kv_view: bool = True,
    kv_view_text: bool = False,
    kv_view_interval: float = 0.25,
) -> FastAPI:
    """The app; the engine loop starts with the app (or at the first request) and stops
    with it. `max_waiting` bounds the backlog: requests waiting beyond what the engine can
    admit (HTTP 503 past it). `body_timeout`: seconds a client has to send its whole body
    (HTTP 408 after). `allowed_origins`: browser origins allowed by CORS ("*" for any).
    `kv_view`: serve the KV view at /kv, updating every `kv_view_interval` seconds at most,
    with token text only if `kv_view_text`."""
    if isinstance(engine, LLMEngine):
        engine = AsyncLLMEngine(engine, max_waiting=max_waiting)
    elif max_waiting is not None:
        engine.max_waiting = max_waiting
    check_limits(max_request_bytes, body_timeout)
    api_key = api_key or None  # "" (e.g. PAGEDLLM_API_KEY="") means no key, as it reads
    async_engine = engine
    llm = async_engine.engine
    name = served_model_name or default_model_name(llm.config.model)
    card = p.ModelCard(id=name, max_model_len=llm.max_model_len)
    metrics = ServerMetrics(async_engine)
    serving = Serving(async_engine, metrics, name)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        try:
            yield
        finally:
            async_engine.shutdown()
            serving.encoder.close()

    # FastAPI's own docs routes cannot take the key: ours below can.
    app = FastAPI(
        title="pagedllm", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.engine = async_engine
    app.state.metrics = metrics
    app.state.model_name = name
    install_error_handlers(app, on_error=lambda e: metrics.rejected.labels(status=e.status).inc())
    if allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(allowed_origins),
            allow_methods=["GET", "HEAD", "POST", "OPTIONS"],
            allow_headers=["Authorization", "Content-Type"],
        )

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
                headers={"WWW-Authenticate": "Bearer"},
            )

    async def read_body(request: Request) -> bytes:
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > max_request_bytes:
            raise _too_large(int(length), max_request_bytes)

        async def read() -> bytes:
            body = bytearray()
            async for chunk in request.stream():
                body += chunk
                if len(body) > max_request_bytes:
                    raise _too_large(None, max_request_bytes)
            return bytes(body)

        try:
            # A client that sends less than its Content-Length (or trickles) would hold
            # the connection and this handler forever.
            return await asyncio.wait_for(read(), body_timeout)
        except asyncio.TimeoutError:
            raise APIError(
                408,
                f"the request body did not arrive within {body_timeout:g} s",
                code="request_timeout",
                headers={"Connection": "close"},  # the rest of the body may still come
            ) from None
        except ClientDisconnect:
            raise client_closed() from None

    async def read_request(request: Request, model: type[M]) -> M:
        body = await read_body(request)
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
        try:
            parsed = model.model_validate(data)
        except ValidationError as exc:
            raise from_validation_error(exc) from None
        requested = getattr(parsed, "model", None)
        if requested is not None and requested != name:
            raise _model_not_found(requested, name)
        return parsed

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        return await serving.completions(await read_request(request, p.CompletionRequest), request)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serving.chat(await read_request(request, p.ChatCompletionRequest), request)

    # HEAD (for probes) stays out of the schema: one operation per route there.
    @v1.head("/models", include_in_schema=False)
    @v1.get("/models")
    async def models() -> JSONResponse:
        return JSONResponse(p.dump(p.ModelList(data=[card])))

    @v1.head("/models/{model_id:path}", include_in_schema=False)
    @v1.get("/models/{model_id:path}")
    async def model(model_id: str) -> JSONResponse:
        if model_id != name:
            raise _model_not_found(model_id, name)
        return JSONResponse(p.dump(card))

    app.include_router(v1)
    if kv_view:
        feed = KVFeed(async_engine, text=kv_view_text, interval=kv_view_interval)
        app.state.kv_feed = feed
        app.include_router(kv_router(feed, api_key, check_api_key))

    @app.head("/health", include_in_schema=False)
    @app.get("/health")
    async def health() -> JSONResponse:
        if not async_engine.healthy:
            raise APIError(503, "the engine loop has stopped", code="engine_dead")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    if enable_docs:
        docs = APIRouter(dependencies=[Depends(check_api_key)], include_in_schema=False)

        @docs.get("/openapi.json")
        async def openapi() -> JSONResponse:
            return JSONResponse(app.openapi())

        @docs.get("/docs")
        async def swagger() -> HTMLResponse:
            return get_swagger_ui_html(openapi_url="/openapi.json", title="pagedllm")

        @docs.get("/redoc")
        async def redoc() -> HTMLResponse:
            return get_redoc_html(openapi_url="/openapi.json", title="pagedllm")

        app.include_router(docs)

    return app


def _model_not_found(requested: str, name: str) -> APIError:
    return APIError(
        404,
        f"the model '{requested}' does not exist; this server serves '{name}'",
        param="model",
        code="model_not_found",
    )


def _too_large(size: int | None, limit: int) -> APIError:
    what = f"the request body ({size} bytes)" if size is not None else "the request body"
    return APIError(
        413,
        f"{what} exceeds the limit of {limit} bytes",
        code="request_too_large",
        headers={"Connection": "close"},  # the rest of the body is not read
    )
