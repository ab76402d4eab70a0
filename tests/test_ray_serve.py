"""pagedllm on Ray Serve: a local Ray cluster (2 CPUs), two engine replicas of the tiny
chat model behind the OpenAI ingress of `pagedllm serve`. Each turn of a multi-turn
conversation goes to the replica that cached the turns before it (the prefix-aware
router), so the cached prompt tokens grow turn after turn by at least the previous
prompt's full blocks; the ingress keeps the key, the errors and streaming of the server.
Skipped where ray is not installed."""

from __future__ import annotations

import pickle
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from live_server import NAME, check_error  # noqa: E402
from pagedllm.engine.config import EngineConfig  # noqa: E402
from pagedllm.entrypoints.ray_serve.app import (  # noqa: E402
    RayServeOptions,
    RouterOptions,
    build_app,
)
from pagedllm.errors import InvalidParameterError  # noqa: E402

KEY = "ray-key"
BLOCK = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def ray_url(chat_model_dir: Path) -> Iterator[str]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        config = EngineConfig(model=str(chat_model_dir), num_kv_blocks=256, block_size=BLOCK)
        options = RayServeOptions(num_replicas=2, router=RouterOptions(stats_period_s=0.5))
        app = build_app(config, options, api_key=KEY, served_model_name=NAME)
        serve.run(app, name="pagedllm", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)


def full_blocks(prompt_tokens: int) -> int:
    """Prompt tokens a replica that computed this prompt serves from its cache next time."""
    return (prompt_tokens - 1) // BLOCK * BLOCK


def test_the_turns_of_a_conversation_follow_its_cache(ray_url: str) -> None:
    c = client(ray_url)
    topics = ["the sea", "mountains"]
    chats: list[list[dict[str, Any]]] = [
        [{"role": "user", "content": f"Tell me a long story about {t}. " * 4}] for t in topics
    ]
    previous = [0, 0]
    for turn in range(3):
        for i, messages in enumerate(chats):  # the conversations interleave
            out = c.chat.completions.create(
                model=NAME, messages=messages, max_tokens=12, temperature=0
            )
            cached = out.usage.prompt_tokens_details.cached_tokens
            if turn > 0:  # everything of the last turn's prompt came from this replica
                assert cached >= full_blocks(previous[i]) > 0, (turn, i)
            previous[i] = out.usage.prompt_tokens
            messages.append({"role": "assistant", "content": out.choices[0].message.content})
            messages.append({"role": "user", "content": f"And then? ({turn})"})
    stats = replica_stats()
    assert len(stats) == 2
    assert sum(len(s["cached"]) for s in stats) > 0


def test_the_ingress_is_the_same_server(ray_url: str) -> None:
    r = httpx.post(ray_url + "/v1/completions", json={"model": NAME, "prompt": "Hi"})
    check_error(r, 401)
    headers = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(
        ray_url + "/v1/completions",
        json={"model": NAME, "prompt": "Hi", "temperature": -1},
        headers=headers,
    )
    check_error(r, 400, param="temperature")
    r = httpx.post(
        ray_url + "/v1/completions",
        json={"model": NAME, "prompt": "Hi", "max_tokens": 10**6},
        headers=headers,
    )
    check_error(r, 400, param="max_tokens")  # the replica's own check, through Ray
    c = client(ray_url)
    whole = c.completions.create(model=NAME, prompt="Once upon", max_tokens=6, temperature=0)
    chunks = list(
        c.completions.create(
            model=NAME,
            prompt="Once upon",
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == 6
    assert c.models.list().data[0].id == NAME
    # /metrics adds up the pools of the replicas that have answered (256 blocks each).
    text = httpx.get(ray_url + "/metrics").text
    total = next(line for line in text.splitlines() if line.startswith("pagedllm:kv_blocks_total"))
    assert float(total.split()[-1]) in (256.0, 512.0)


def test_serve_takes_the_ray_options() -> None:
    from pagedllm.entrypoints.cli import build_parser

    args = build_parser().parse_args(
        ["serve", "--ray", "--num-replicas", "3", "--routing", "pow2", "--replica-gpus", "1"]
    )
    assert (args.ray, args.num_replicas, args.routing, args.replica_gpus) == (True, 3, "pow2", 1)
    with pytest.raises(InvalidParameterError) as info:
        RayServeOptions(routing="random")
    assert info.value.param == "routing"
    error = pickle.loads(pickle.dumps(InvalidParameterError("max_tokens", "too many", "x")))
    assert (error.param, str(error), error.code) == ("max_tokens", "too many", "x")


def replica_stats() -> list[dict[str, Any]]:
    """Each engine replica's routing stats, asked of its actor directly."""
    names = [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if "EngineReplica" in a["name"]
    ]
    actors = [ray.get_actor(name, namespace="serve") for name in names]
    return ray.get([a.record_routing_stats.remote() for a in actors], timeout=30)
