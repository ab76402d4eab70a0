"""create_app(engine, ...): the OpenAI-compatible FastAPI app over one engine.

Routes: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses (the
Responses API: responses_api.py), GET|HEAD /v1/models and GET /v1/models/{id},
POST /tokenize, POST /detokenize and GET /tokenizer_info (tokenization.py; all behind
the API key when one is set; an empty key is no key),
GET|HEAD /health, GET /metrics, the KV view under /kv unless `kv_view=False` (behind the
key too; see kv_routes.py), and, only with `enable_docs`, /docs, /redoc and /openapi.json
(behind the key too). Request bodies are read by hand, so the checks run in
a fixed order: API key (401), size (413), arrival within `body_timeout` (408), JSON (400),
fields (400), model name (404), unsupported fields and sampling values (400), prompt text
(400), context and KV-pool fit (400), grammar (400; 503 while the compilers are busy),
backlog (503). Bad client input is never a 500.

The pieces live beside it: the key check in auth.py, body reading and JSON parsing in
body.py, the routers in routes.py and kv_routes.py, request ids and the headers every
response carries in request_id.py.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import cast

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.engine.engine_client import EngineClient, KVViewSource, LocalEngineClient
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.server.auth import ApiKey
from pagedllm.entrypoints.server.body import BodyReader, RequestReader
from pagedllm.entrypoints.server.errors import install_error_handlers
from pagedllm.entrypoints.server.kv_feed import KVFeed
from pagedllm.entrypoints.server.kv_routes import kv_router
from pagedllm.entrypoints.server.limits import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_MAX_PROMPTS_PER_REQUEST,
    DEFAULT_MAX_REQUEST_BYTES,
    check_limits,
)
from pagedllm.entrypoints.server.lora_modules import LoRAModule, ServedModels
from pagedllm.entrypoints.server.lora_routes import lora_router
from pagedllm.entrypoints.server.metrics import ServerMetrics
from pagedllm.entrypoints.server.reasoning import reasoning_parser as find_reasoning_parser
from pagedllm.entrypoints.server.request_id import RequestIdMiddleware
from pagedllm.entrypoints.server.routes import api_router, docs_router, ops_router
from pagedllm.entrypoints.server.serving import Serving
from pagedllm.entrypoints.server.tokenization import tokenizer_router
from pagedllm.entrypoints.server.tool_parsers import DEFAULT_PARSER, parser_factory
from pagedllm.loader.hf_cache import is_repo_id
from pagedllm.lora import LoRARequest
from pagedllm.validation import check_int

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_model_name(model_path: str | None) -> str:
    """The name served by default: a hub name (`org/name`) as given, as vLLM serves it,
    else the model file's or folder's name."""
    if model_path is None:
        return DEFAULT_MODEL_NAME
    if is_repo_id(model_path) and not os.path.exists(model_path):
        return model_path
    name = os.path.basename(os.path.normpath(model_path))
    return name[: -len(".gguf")] if name.lower().endswith(".gguf") else name


def served_names(names: str | Sequence[str] | None, model_path: str | None) -> tuple[str, ...]:
    """The names clients may send, the first echoed in responses; ValueError if empty."""
    if names is None:
        return (default_model_name(model_path),)
    listed = (names,) if isinstance(names, str) else tuple(dict.fromkeys(names))
    if not listed or not all(isinstance(n, str) and n for n in listed):
        raise ValueError(f"served model names must be non-empty strings, got {names!r}")
    return listed


def create_app(
    engine: LLMEngine | EngineClient,
    *,
    served_model_name: str | Sequence[str] | None = None,
    api_key: str | None = None,
    max_waiting: int | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    body_timeout: float = DEFAULT_BODY_TIMEOUT_S,
    max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST,
    allowed_origins: Sequence[str] = (),
    enable_docs: bool = False,
    kv_view: bool = True,
    kv_view_text: bool = False,
    kv_view_interval: float = 0.25,
    tool_call_parser: str = DEFAULT_PARSER,
    reasoning_parser: str | None = None,
    lora_modules: Sequence[LoRAModule] = (),
    enable_lora_loading: bool = False,
    lora_dir: str | None = None,
) -> FastAPI:
    """The app over `engine` (an LLMEngine is run on an AsyncLLMEngine); the engine loop
    starts with the app (or at the first request) and stops with it. `served_model_name`:
    the model name, or names, that requests may give (the first is echoed in responses;
    default: default_model_name). `max_waiting` bounds
    the backlog: requests waiting beyond what the engine can admit (HTTP 503 past it), each
    prompt of a batch counted. `max_prompts_per_request`: the most prompts one
    /v1/completions request may carry (HTTP 400 past it). `body_timeout`: seconds a client
    has to send its whole body (HTTP 408 after). `allowed_origins`: browser origins allowed
    by CORS ("*" for any). `kv_view`: serve the KV view at /kv, updating every
    `kv_view_interval` seconds at most, with token text only if `kv_view_text`.
    `max_waiting` and `kv_view` need an engine in this process (ValueError otherwise).
    `tool_call_parser`: how the model writes a tool call, read back under tool_choice
    "auto" (tool_parsers.py; ValueError if unknown). `reasoning_parser` ("deepseek_r1" or
    "qwen3"; None: off): splits a chat answer's `<think>` reasoning into
    `reasoning_content` (reasoning.py; ValueError if unknown). `lora_modules`: adapters
    served from the start under their names (lora_int_id 1, 2, ... in order; each checked
    by the engine as the app starts, which fails on a bad one); `enable_lora_loading`:
    serve /v1/load_lora_adapter and /v1/unload_lora_adapter, loading only from under
    `lora_dir`. Both need an engine with `enable_lora` (ValueError otherwise)."""
    if isinstance(engine, LLMEngine):
        engine = AsyncLLMEngine(engine, max_waiting=max_waiting)
    in_process = local_engine(engine)
    if in_process is None and (max_waiting is not None or kv_view):
        raise ValueError(
            "max_waiting and kv_view need an engine in this process: engine replicas "
            "bound their own backlog, and the KV view watches one pool"
        )
    if in_process is not None and max_waiting is not None:
        in_process.max_waiting = check_int(max_waiting, "max_waiting", min=0)
    check_limits(max_request_bytes, body_timeout, max_prompts_per_request)
    key = ApiKey(api_key)
    names = served_names(served_model_name, engine.config.model)
    name = names[0]
    lora_dir = check_lora_options(
        engine.config.enable_lora, lora_modules, enable_lora_loading, lora_dir
    )
    models = ServedModels(names, engine.config.model, lora_modules)
    metrics = ServerMetrics(engine)
    serving = Serving(
        engine,
        metrics,
        name,
        parser_factory(tool_call_parser),
        max_prompts_per_request,
        find_reasoning_parser(reasoning_parser),
        models,
    )

    # FastAPI's own docs routes cannot take the key: docs_router's can.
    app = FastAPI(
        title="pagedllm",
        lifespan=_lifespan(engine, serving, list(models.adapters())),
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.model_name = name
    install_error_handlers(app, on_error=lambda e: metrics.rejected.labels(status=e.status).inc())
    if allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(allowed_origins),
            allow_methods=["GET", "HEAD", "POST", "OPTIONS"],
            # Any header, as vLLM: the official clients send their own (x-stainless-*).
            allow_headers=["*"],
            expose_headers=["X-Request-Id"],
        )
    app.add_middleware(RequestIdMiddleware)  # added last: outermost, so on every response

    reader = RequestReader(BodyReader(max_request_bytes, body_timeout), models)
    max_len = engine.max_model_len
    app.include_router(api_router(serving, reader, lambda: models.cards(max_len), key))
    if enable_lora_loading:
        assert lora_dir is not None  # check_lora_options
        app.include_router(lora_router(engine, models, reader, lora_dir, key))
    app.include_router(tokenizer_router(engine, serving.encoder, reader, key))
    if in_process is not None and kv_view:
        feed = KVFeed(in_process, text=kv_view_text, interval=kv_view_interval)
        app.state.kv_feed = feed
        app.include_router(kv_router(feed, key))
    app.include_router(ops_router(engine, metrics))
    if enable_docs:
        app.include_router(docs_router(app, key))
    return app


def local_engine(engine: EngineClient) -> LocalEngineClient | None:
    """`engine` if it runs in this process (it has the KV view's methods: KVViewSource,
    which the Ray replicas' RemoteEngine has not), else None."""
    return cast(LocalEngineClient, engine) if isinstance(engine, KVViewSource) else None


def check_lora_options(
    enable_lora: bool,
    lora_modules: Sequence[LoRAModule],
    enable_lora_loading: bool,
    lora_dir: str | None,
) -> str | None:
    """The LoRA directory (resolved) if loading is on; ValueError for options that do not
    go together (adapters without an engine that runs them, loading without a directory
    to load from)."""
    if (lora_modules or enable_lora_loading) and not enable_lora:
        raise ValueError("--lora-modules and --enable-lora-loading need --enable-lora")
    if not enable_lora_loading:
        if lora_dir is not None:
            raise ValueError("--lora-dir is read only with --enable-lora-loading")
        return None
    if not lora_dir:
        raise ValueError(
            "--enable-lora-loading needs --lora-dir: the folder whose adapters clients may load"
        )
    if not os.path.isdir(lora_dir):
        raise ValueError(f"--lora-dir {lora_dir!r} is not a folder")
    return os.path.realpath(lora_dir)


def _lifespan(
    engine: EngineClient, serving: Serving, loras: Iterable[LoRARequest] = ()
) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """Start the engine loop with the app, and check the adapters served from the start
    (a bad one stops the app before it serves); stop it, and the tokenizer thread, after."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            for lora in loras:
                await engine.check_lora(lora)
            yield
        finally:
            engine.shutdown()
            serving.encoder.close()

    return lifespan
