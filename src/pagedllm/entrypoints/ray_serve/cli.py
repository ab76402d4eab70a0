"""`pagedllm serve --ray`: the server's options, the engine's and the replicas', to a Ray
Serve application on the same host and port, running until interrupted."""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Sequence

import ray
from ray import serve

from pagedllm.engine.config import EngineConfig
from pagedllm.entrypoints.ray_serve.app import RayServeOptions, RouterOptions, build_app
from pagedllm.entrypoints.server.lora_modules import LoRAModule


def run_ray_serve(
    args: argparse.Namespace, config: EngineConfig, lora_modules: Sequence[LoRAModule] = ()
) -> int:
    log = logging.getLogger("pagedllm")
    resources = {"num_cpus": args.replica_cpus}
    if args.replica_gpus:
        resources["num_gpus"] = args.replica_gpus
    options = RayServeOptions(
        num_replicas=args.num_replicas,
        routing=args.routing,
        router=RouterOptions(max_imbalance=args.max_imbalance),
        replica_actor_options=resources,
    )
    app = build_app(
        config,
        options,
        api_key=args.api_key,
        served_model_name=args.served_model_name,
        max_waiting=args.max_waiting,
        max_request_bytes=args.max_request_bytes,
        body_timeout=args.body_timeout,
        max_prompts_per_request=args.max_prompts_per_request,
        allowed_origins=[o.strip() for o in args.allowed_origins.split(",") if o.strip()],
        enable_docs=args.enable_docs,
        reasoning_parser=args.reasoning_parser,
        lora_modules=tuple(lora_modules),  # each replica runs them; the ingress names them
    )
    ray.init()  # $RAY_ADDRESS's cluster, else a local one
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(app, name="pagedllm", route_prefix="/")
    log.info(
        "serving at http://%s:%d/v1 on %d Ray Serve replicas (%s routing)",
        args.host,
        args.port,
        args.num_replicas,
        args.routing,
    )
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
    return 0
