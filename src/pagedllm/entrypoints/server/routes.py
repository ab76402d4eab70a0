"""The server's routers: the OpenAI API under /v1 (`api_router`), the operator's
endpoints /health and /metrics (`ops_router`) and the optional API docs (`docs_router`).
Each takes what it serves and the API key dependency; create_app (app.py) joins them.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

import pagedllm.entrypoints.server.responses as r
from pagedllm.engine.engine_client import EngineClient
from pagedllm.entrypoints.server.auth import ApiKey
from pagedllm.entrypoints.server.body import RequestReader, model_not_found
from pagedllm.entrypoints.server.chat_protocol import ChatCompletionRequest
from pagedllm.entrypoints.server.csp import policy
from pagedllm.entrypoints.server.errors import APIError
from pagedllm.entrypoints.server.metrics import ServerMetrics
from pagedllm.entrypoints.server.protocol import CompletionRequest
from pagedllm.entrypoints.server.responses_api import create_response
from pagedllm.entrypoints.server.responses_protocol import ResponsesRequest
from pagedllm.entrypoints.server.serving import Serving

# Where FastAPI's docs pages load Swagger UI and ReDoc from (its defaults).
DOCS_CDN = "https://cdn.jsdelivr.net"
DOCS_FONTS = ("https://fonts.googleapis.com", "https://fonts.gstatic.com")


def api_router(
    serving: Serving,
    reader: RequestReader,
    cards: Callable[[], list[r.ModelCard]],
    api_key: ApiKey,
) -> APIRouter:
    """POST /v1/completions, POST /v1/chat/completions, POST /v1/responses,
    GET|HEAD /v1/models[/{id}] (`cards()`: one card per served name and LoRA adapter)."""
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(api_key)])

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        return await serving.completions(await reader.read(request, CompletionRequest), request)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serving.chat(await reader.read(request, ChatCompletionRequest), request)

    @v1.post("/responses")
    async def responses(request: Request) -> Response:
        return await create_response(serving, await reader.read(request, ResponsesRequest), request)

    # HEAD (for probes) stays out of the schema: one operation per route there.
    @v1.head("/models", include_in_schema=False)
    @v1.get("/models")
    async def models() -> JSONResponse:
        return JSONResponse(r.dump(r.ModelList(data=cards())))

    @v1.head("/models/{model_id:path}", include_in_schema=False)
    @v1.get("/models/{model_id:path}")
    async def model(model_id: str) -> JSONResponse:
        served = cards()
        card = next((c for c in served if c.id == model_id), None)
        if card is None:
            raise model_not_found(model_id, [c.id for c in served])
        return JSONResponse(r.dump(card))

    return v1


def ops_router(engine: EngineClient, metrics: ServerMetrics) -> APIRouter:
    """GET|HEAD /health (503 once the engine loop has stopped) and GET /metrics; no key."""
    ops = APIRouter()

    @ops.head("/health", include_in_schema=False)
    @ops.get("/health")
    async def health() -> JSONResponse:
        if not engine.healthy:
            raise APIError(503, "the engine loop has stopped", code="engine_dead")
        return JSONResponse({"status": "ok"})

    @ops.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return ops


def docs_router(app: FastAPI, api_key: ApiKey) -> APIRouter:
    """/openapi.json, /docs and /redoc, behind the key (FastAPI's own cannot take it)."""
    docs = APIRouter(dependencies=[Depends(api_key)], include_in_schema=False)

    @docs.get("/openapi.json")
    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @docs.get("/docs")
    async def swagger() -> HTMLResponse:
        return _with_policy(get_swagger_ui_html(openapi_url="/openapi.json", title="pagedllm"))

    @docs.get("/redoc")
    async def redoc() -> HTMLResponse:
        return _with_policy(get_redoc_html(openapi_url="/openapi.json", title="pagedllm"))

    return docs


def _with_policy(page: HTMLResponse) -> HTMLResponse:
    """A docs page with a policy that lets it load its viewer from the CDN it names."""
    html = bytes(page.body).decode("utf-8")
    page.headers["Content-Security-Policy"] = policy(
        html,
        connect=("'self'",),
        scripts=(DOCS_CDN,),
        styles=(DOCS_CDN, DOCS_FONTS[0]),
        fonts=(DOCS_FONTS[1],),
        images=("'self'", "data:", "https:"),
    )
    return page
