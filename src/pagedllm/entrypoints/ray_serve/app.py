"""build_app: the OpenAI-compatible server as a Ray Serve application of N engine replicas.

One ingress deployment serves the very app of `pagedllm serve` (entrypoints/server/
app.py's create_app: same routes, streaming, API key, errors, /metrics) over a
RemoteEngine whose requests go through a handle to the EngineReplica deployment. With
`routing="prefix"` the handle routes with PrefixAwareRouter (replicas report their
cached block hashes as routing stats every `stats_period_s`); with "pow2", Ray's default
power-of-two-choices router. Run it with `serve.run(build_app(config, ...))`, or
`pagedllm serve --ray --num-replicas N`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from pagedllm.engine.config import EngineConfig
from pagedllm.entrypoints.ray_serve.prefix_router import PrefixAwareRouter
from pagedllm.entrypoints.ray_serve.remote_engine import RemoteEngine
from pagedllm.entrypoints.ray_serve.replica import EngineReplica
from pagedllm.errors import InvalidParameterError
from pagedllm.validation import check_int

ROUTINGS = ("prefix", "pow2")


@dataclass(frozen=True)
class RouterOptions:
    """The prefix-aware router's thresholds (prefix_router.py)."""

    max_imbalance: int = 4  # ongoing requests more than the least-loaded replica's
    min_match_blocks: int = 1
    recent_ttl_s: float = 30.0
    stats_period_s: float = 1.0  # how often replicas report their cached hashes

    def __post_init__(self) -> None:
        check_int(self.max_imbalance, "max_imbalance", min=0)
        check_int(self.min_match_blocks, "min_match_blocks", min=1)
        if self.stats_period_s <= 0 or self.recent_ttl_s < 0:
            raise InvalidParameterError(
                "stats_period_s", "stats_period_s must be > 0 and recent_ttl_s >= 0"
            )


@serve.ingress()
class OpenAIIngress:
    """The FastAPI app of `pagedllm serve`, built in the replica over the engines' handle."""

    async def __init__(
        self, replicas: DeploymentHandle, config: EngineConfig, server: dict[str, Any]
    ) -> None:
        from pagedllm.loader.tokenizer import load_tokenizer

        self.server = dict(server)
        self.server.pop("max_waiting", None)  # the replicas' to enforce
        max_model_len = await replicas.max_model_len.remote()
        self.engine = RemoteEngine(replicas, config, load_tokenizer(config.model), max_model_len)

    def __serve_build_asgi_app__(self) -> Any:
        from pagedllm.entrypoints.server.app import create_app

        # The KV view watches one engine's pool in process: not across replicas.
        return create_app(self.engine, kv_view=False, **self.server)


@dataclass(frozen=True)
class RayServeOptions:
    num_replicas: int = 2
    routing: str = "prefix"
    router: RouterOptions = field(default_factory=RouterOptions)
    # Ray actor options of each engine replica, e.g. {"num_cpus": 2} or {"num_gpus": 1}.
    replica_actor_options: dict[str, Any] = field(default_factory=dict)
    max_ongoing_requests: int = 256  # per replica: what Ray Serve sends it at once
    # How often Serve's controller checks each replica (Ray's defaults): a replica whose
    # process died is found within a period and replaced by a new one.
    health_check_period_s: float = 10.0
    health_check_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        check_int(self.num_replicas, "num_replicas", min=1)
        if self.health_check_period_s <= 0 or self.health_check_timeout_s <= 0:
            raise InvalidParameterError(
                "health_check_period_s",
                "health_check_period_s and health_check_timeout_s must be > 0",
            )
        if self.routing not in ROUTINGS:
            raise InvalidParameterError(
                "routing", f"routing must be one of {', '.join(ROUTINGS)}, got {self.routing!r}"
            )


def build_app(
    config: EngineConfig, options: RayServeOptions | None = None, **server: Any
) -> serve.Application:
    """The application; `server`: create_app's options (api_key, served_model_name,
    max_waiting, max_request_bytes, body_timeout, max_prompts_per_request, allowed_origins,
    enable_docs, reasoning_parser, lora_modules). Loading adapters at run time is refused:
    a load must reach every replica."""
    if server.get("enable_lora_loading"):
        raise ValueError(
            "enable_lora_loading is not available over Ray Serve: a load must reach every "
            "engine replica; serve the adapters with lora_modules instead"
        )
    options = options or RayServeOptions()
    deployment_options: dict[str, Any] = dict(
        name="EngineReplica",
        num_replicas=options.num_replicas,
        max_ongoing_requests=options.max_ongoing_requests,
        ray_actor_options=options.replica_actor_options or {"num_cpus": 1},
        health_check_period_s=options.health_check_period_s,
        health_check_timeout_s=options.health_check_timeout_s,
    )
    if options.routing == "prefix":
        r = options.router
        deployment_options["request_router_config"] = RequestRouterConfig(
            request_router_class=PrefixAwareRouter,
            request_router_kwargs=dict(
                block_size=config.block_size,
                max_imbalance=r.max_imbalance,
                min_match_blocks=r.min_match_blocks,
                recent_ttl_s=r.recent_ttl_s,
            ),
            request_routing_stats_period_s=r.stats_period_s,
            request_routing_stats_timeout_s=max(5.0, 3 * r.stats_period_s),
        )
    replicas = serve.deployment(EngineReplica).options(**deployment_options)
    ingress = serve.deployment(OpenAIIngress).options(
        name="OpenAIIngress", ray_actor_options={"num_cpus": 0}
    )
    engine_app = replicas.bind(config, server.get("max_waiting"))
    return ingress.bind(engine_app, config, server)
