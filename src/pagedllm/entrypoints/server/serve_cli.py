"""`pagedllm serve`: load the model, build the engine and run the OpenAI-compatible server
with uvicorn. Binds to 127.0.0.1 unless told otherwise; FastAPI and uvicorn are imported
only when the command runs, so `pagedllm --help` stays fast."""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from pagedllm.entrypoints.engine_args import add_engine_args, engine_config
from pagedllm.entrypoints.server.limits import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_MAX_PROMPTS_PER_REQUEST,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    check_limits,
    check_shutdown_timeout,
)
from pagedllm.entrypoints.server.reasoning import REASONING_PARSERS
from pagedllm.entrypoints.server.tool_parsers import DEFAULT_PARSER, PARSERS


def add_serve_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    p.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="the model to serve, as --model takes it (the same as --model MODEL)",
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)"
    )
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        default=os.environ.get("PAGEDLLM_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1 (default: $PAGEDLLM_API_KEY; "
        "empty: no key)",
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the model names clients may send, the first echoed in responses (default: "
        "the model as given for a hub name org/name, else the model file's name)",
    )
    p.add_argument(
        "--max-waiting",
        type=int,
        default=None,
        help="refuse new requests with 503 while this many are waiting beyond what the "
        "engine can admit, or when a request's prompts would take the count past it "
        "(default: no limit)",
    )
    p.add_argument(
        "--max-prompts-per-request",
        type=int,
        default=DEFAULT_MAX_PROMPTS_PER_REQUEST,
        help="most prompts in one /v1/completions batch (400 beyond; default %(default)s)",
    )
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="largest request body accepted, in bytes (413 beyond; default %(default)s)",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=DEFAULT_BODY_TIMEOUT_S,
        help="seconds a client has to send its whole request body (408 after; default %(default)g)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=None,
        help="on SIGTERM or SIGINT, seconds running requests may go on before they end with "
        f"an error (new ones are refused at once; default {DEFAULT_SHUTDOWN_TIMEOUT_S:g})",
    )
    p.add_argument(
        "--allowed-origins",
        default="",
        help="comma-separated browser origins allowed by CORS, '*' for any (default: none)",
    )
    p.add_argument(
        "--enable-docs",
        action="store_true",
        help="serve /docs, /redoc and /openapi.json (behind the API key when one is set)",
    )
    p.add_argument(
        "--no-kv-view",
        dest="kv_view",
        action="store_false",
        help="do not serve the live KV-cache view at /kv (default: served, behind the API key)",
    )
    p.add_argument(
        "--kv-view-text",
        action="store_true",
        help="let the KV view show the token text held in each block (default: ids and "
        "counts only)",
    )
    p.add_argument(
        "--tool-call-parser",
        default=DEFAULT_PARSER,
        choices=sorted(PARSERS),
        help="the model's tool-call format, read back under tool_choice 'auto' "
        "(default %(default)s: <tool_call>{...}</tool_call>, as Hermes, Qwen and SmolLM2 write)",
    )
    p.add_argument(
        "--reasoning-parser",
        default=None,
        choices=sorted(REASONING_PARSERS),
        help="split a thinking model's <think>...</think> reasoning from its chat answer into "
        "reasoning_content; deepseek_r1: the output starts in reasoning (R1 distills, whose "
        "template opens the block); qwen3: only a <think> opens it (default: no split)",
    )
    lora = p.add_argument_group("LoRA adapters (with --enable-lora)")
    lora.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="adapters served from the start, each as name=path or JSON "
        '{"name": ..., "path": ...}; a request picks one by its model field',
    )
    lora.add_argument(
        "--enable-lora-loading",
        action="store_true",
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind the API "
        "key), loading only from under --lora-dir; not with --ray",
    )
    lora.add_argument(
        "--lora-dir",
        default=None,
        help="with --enable-lora-loading: the folder clients may load adapters from (a "
        "lora_path outside it, after resolving symlinks and '..', is refused)",
    )
    p.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    ray = p.add_argument_group("Ray Serve (pip install pagedllm[ray])")
    ray.add_argument(
        "--ray",
        action="store_true",
        help="serve N engine replicas on Ray Serve behind one ingress (joins the Ray cluster "
        "of $RAY_ADDRESS, else starts a local one); the KV view is not served",
    )
    ray.add_argument("--num-replicas", type=int, default=2, help="engine replicas (with --ray)")
    ray.add_argument(
        "--routing",
        default="prefix",
        choices=["prefix", "pow2"],
        help="prefix: to the replica caching the longest prefix of the prompt (load-balanced "
        "past --max-imbalance); pow2: Ray's default power-of-two-choices (default: prefix)",
    )
    ray.add_argument(
        "--max-imbalance",
        type=int,
        default=4,
        help="prefix routing: take the least-loaded replica instead when the best match has "
        "more than this many ongoing requests beyond it (default %(default)s)",
    )
    ray.add_argument(
        "--replica-cpus",
        type=float,
        default=1.0,
        help="CPUs Ray reserves for each replica (default %(default)s)",
    )
    ray.add_argument(
        "--replica-gpus", type=float, default=0.0, help="GPUs per replica (default none)"
    )
    add_engine_args(p)
    p.set_defaults(func=run_serve)
    return p


def take_model_tag(args: argparse.Namespace) -> None:
    """`pagedllm serve MODEL` is `--model MODEL`; both, naming different models, is an error."""
    if args.model_tag is None:
        return
    if args.model is not None and args.model != args.model_tag:
        raise ValueError(
            f"the model is given twice, as {args.model_tag!r} and --model {args.model!r}: "
            "give it once"
        )
    args.model = args.model_tag


def run_serve(args: argparse.Namespace) -> int:
    from pagedllm.engine.async_engine import AsyncLLMEngine
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.entrypoints.server.app import check_lora_options, create_app
    from pagedllm.entrypoints.server.lora_modules import module_requests, parse_lora_modules
    from pagedllm.entrypoints.server.shutdown import serve

    logging.getLogger("pagedllm").setLevel(args.log_level.upper())
    # Bad values fail here, before a model loads (create_app checks the limits again).
    check_limits(args.max_request_bytes, args.body_timeout, args.max_prompts_per_request)
    shutdown_timeout = args.shutdown_timeout
    if args.ray and shutdown_timeout is not None:
        raise ValueError(
            "--shutdown-timeout is not read with --ray: Ray Serve stops its replicas by its "
            "own graceful shutdown"
        )
    if shutdown_timeout is None:
        shutdown_timeout = DEFAULT_SHUTDOWN_TIMEOUT_S
    check_shutdown_timeout(shutdown_timeout)
    take_model_tag(args)
    config = engine_config(args)
    lora_modules = parse_lora_modules(args.lora_modules)
    if args.ray and args.enable_lora_loading:
        raise ValueError(
            "--enable-lora-loading is not available with --ray: a load must reach every "
            "engine replica; serve the adapters with --lora-modules instead"
        )
    check_lora_options(config.enable_lora, lora_modules, args.enable_lora_loading, args.lora_dir)
    if args.ray:
        from pagedllm.entrypoints.ray_serve.cli import run_ray_serve

        return run_ray_serve(args, config, lora_modules)

    def make_engine() -> LLMEngine:
        engine = LLMEngine(config)
        for lora in module_requests(lora_modules):  # a bad adapter fails before serving
            engine.check_lora(lora)
        return engine

    # Built on the loop's thread: all torch work on one thread (see AsyncLLMEngine.build).
    engine = AsyncLLMEngine.build(make_engine, max_waiting=args.max_waiting)
    try:
        app = create_app(
            engine,
            served_model_name=args.served_model_name,
            api_key=args.api_key,
            max_request_bytes=args.max_request_bytes,
            body_timeout=args.body_timeout,
            max_prompts_per_request=args.max_prompts_per_request,
            allowed_origins=[o.strip() for o in args.allowed_origins.split(",") if o.strip()],
            enable_docs=args.enable_docs,
            kv_view=args.kv_view,
            kv_view_text=args.kv_view_text,
            tool_call_parser=args.tool_call_parser,
            reasoning_parser=args.reasoning_parser,
            lora_modules=lora_modules,
            enable_lora_loading=args.enable_lora_loading,
            lora_dir=args.lora_dir,
        )
        key = "required" if args.api_key else "not required"
        if args.api_key == "":
            key += ": the API key given is empty, which means no key"
        logging.getLogger("pagedllm").info(
            "serving '%s' at http://%s:%d/v1 (API key %s)",
            app.state.model_name,
            args.host,
            args.port,
            key,
        )
        if args.kv_view:
            logging.getLogger("pagedllm").info(
                "KV cache view at http://%s:%d/kv%s",
                args.host,
                args.port,
                " (with token text)" if args.kv_view_text else "",
            )
        serve(app, shutdown_timeout, host=args.host, port=args.port, log_level=args.log_level)
    finally:  # the app's lifespan stops it too, if uvicorn got as far as starting the app
        engine.shutdown()
    return 0
