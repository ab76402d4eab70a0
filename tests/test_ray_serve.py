"""pagedllm on Ray Serve: a local Ray cluster (2 CPUs), two engine replicas of the tiny
chat model behind the OpenAI ingress of `pagedllm serve`. Each turn of a multi-turn
conversation goes to the replica that cached the turns before it (the prefix-aware
router), so the cached prompt tokens grow turn after turn by at least the previous
prompt's full blocks; the ingress keeps the key, the errors and streaming of the server.
A replica killed while it streams ends its requests with clean errors, new requests go
to the live replica, and Ray Serve brings up a replacement. Skipped where ray is not
installed."""

from __future__ import annotations

import json
import os
import pickle
import signal
import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from live_server import NAME, check_error  # noqa: E402
from pagedllm.engine.config import EngineConfig  # noqa: E402
from pagedllm.engine.listeners import StepListener  # noqa: E402
from pagedllm.entrypoints.ray_serve.app import (  # noqa: E402
    RayServeOptions,
    RouterOptions,
    build_app,
)
from pagedllm.errors import InvalidParameterError  # noqa: E402

KEY = "ray-key"
BLOCK = 16
STATS_PERIOD_S = 0.5


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
        # The router's memory of its own recent choices off: it routes by what the
        # replicas report only, so routing holds only if its hashes are the engine's.
        options = RayServeOptions(
            num_replicas=2,
            router=RouterOptions(stats_period_s=STATS_PERIOD_S, recent_ttl_s=0),
            health_check_period_s=1.0,  # a killed replica is replaced within seconds
        )
        app = build_app(config, options, api_key=KEY, served_model_name=NAME)
        serve.run(app, name="pagedllm", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)


def stats_pulled() -> None:
    """Wait for Ray Serve to pull every replica's routing stats (its cached hashes) at
    least once more: what a replica cached so far is then what the router knows."""
    time.sleep(4 * STATS_PERIOD_S)


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
            stats_pulled()
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
    # The tokenizer endpoints use the ingress's tokenizer, as the prompts above did.
    r = httpx.post(ray_url + "/tokenize", json={"prompt": "Once upon"}, headers=headers)
    assert r.json()["count"] == whole.usage.prompt_tokens
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


def test_the_scale_out_bench_reports_its_figures(
    ray_url: str, chat_model_dir: Path, tmp_path: Path
) -> None:
    """`pagedllm bench scale-out` at a tiny size on this module's cluster, next to its
    application (under /bench, reserving no CPU): one system, to keep it short; the
    comparisons between systems are tested in test_bench_scale_out.py."""
    from pagedllm.bench import scale_out
    from pagedllm.entrypoints.cli import build_parser

    argv = ["bench", "scale-out", "--model", str(chat_model_dir), "--num-kv-blocks", "64"]
    argv += ["--systems", "single", "--num-replicas", "2", "--replica-cpus", "0"]
    argv += ["--conversations", "2", "--turns", "2", "--passage-words", "40"]
    argv += ["--output-len", "4", "--port", ray_url.rsplit(":", 1)[1]]
    argv += ["--route-prefix", "/bench", "--out", str(tmp_path)]
    result = scale_out.run(build_parser().parse_args(argv))
    assert result["exit_code"] == 0 and result["errors"] == []
    (row,) = result["results"]
    assert (row["system"], row["replicas"], row["kv_blocks_per_replica"]) == ("single", 1, 128)
    assert (row["turns"], row["failed"]) == (4, 0) and 0 < row["output_tokens"] <= 16
    assert row["computed_tokens"] == row["prompt_tokens"] - row["cached_tokens"] > 0
    assert 0 < row["later_turn_hit_rate"] <= 1 and 0 < row["hit_rate"] < 1
    assert row["ttft_mean_ms"] > 0 and row["output_throughput"] > 0
    assert row["torch_threads_per_replica"] >= 1
    assert (row["hit_rate_vs_single"], row["computed_vs_pow2"]) == (1.0, None)
    turns = {(t["conversation"], t["turn"]): t for t in result["records"]["single"]}
    for conversation in (0, 1):  # the second turn gets the first's full prompt blocks
        first, second = turns[conversation, 0], turns[conversation, 1]
        assert second["cached_tokens"] >= full_blocks(first["prompt_tokens"])
    assert (tmp_path / "scale-out.json").exists() and (tmp_path / "scale-out.md").exists()
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    assert not [name for name in names if "scale-out" in name]  # taken down


def engine_replicas() -> dict[str, Any]:
    """The live engine replicas' actors by name."""
    names = [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if "EngineReplica" in a["name"]
    ]
    return {name: ray.get_actor(name, namespace="serve") for name in names}


def replica_stats() -> list[dict[str, Any]]:
    """Each engine replica's routing stats, asked of its actor directly."""
    actors = engine_replicas().values()
    return ray.get([a.record_routing_stats.remote() for a in actors], timeout=30)


def wait_for(what: Callable[[], Any], seconds: float, message: str) -> Any:
    """`what()` once it is truthy, polled until `seconds` have passed."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = what()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"{message} within {seconds} s")


def pid_of(actor: Any) -> int:
    """The process id of a replica's actor."""
    return int(ray.get(actor.__ray_call__.remote(lambda _: os.getpid()), timeout=30))


def busy_replica(actors: dict[str, Any]) -> str | None:
    """The replica running (or queuing) two requests, if one is."""
    for name, actor in actors.items():
        stats = ray.get(actor.record_routing_stats.remote(), timeout=10)
        if stats["running"] + stats["waiting"] >= 2:
            return name
    return None


def throttle(actor: Any, seconds: float) -> None:
    """Make each of the replica's engine steps take `seconds` longer (0: as before), so
    that a stream outlasts the test's waits however fast the machine is."""

    def set_delay(actor_self: Any) -> None:
        # The Serve actor wraps our EngineReplica (a private attribute of Ray Serve's).
        replica = actor_self._replica_impl._user_callable_wrapper._callable
        remove = getattr(replica, "_test_throttle", None)
        if remove is not None:
            remove()
        delay = {"on_step_end": lambda self, *args: time.sleep(seconds)}
        slow = type("SlowSteps", (StepListener,), delay)()
        replica._test_throttle = replica.engine.engine.add_listener(slow) if seconds else None

    ray.get(actor.__ray_call__.remote(set_delay), timeout=30)


def test_a_replica_killed_while_it_streams(ray_url: str) -> None:
    actors = engine_replicas()
    assert len(actors) == 2
    pids = {name: pid_of(actor) for name, actor in actors.items()}
    for actor in actors.values():  # 400 tokens take 8 s or more: the kill comes first
        throttle(actor, 0.02)
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": NAME, "prompt": "A long story about the sea. " * 8, "temperature": 0}
    body |= {"max_tokens": 400, "ignore_eos": True}
    timeout = httpx.Timeout(30.0)  # every wait below is bounded: a hang fails the test
    with (
        httpx.Client(base_url=ray_url, headers=headers, timeout=timeout) as http,
        ThreadPoolExecutor(1) as pool,
        http.stream("POST", "/v1/completions", json=body | {"stream": True}) as stream,
    ):
        assert stream.status_code == 200
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # it streams
        stats_pulled()
        # The same prompt: the router sends it to the replica holding its prefix.
        whole = pool.submit(
            httpx.post,
            ray_url + "/v1/completions",
            json=body,
            headers=headers,
            timeout=timeout,  # not httpx's 5 s: finding the busy replica may take longer
        )
        busy = wait_for(lambda: busy_replica(actors), 10, "the requests did not run on one replica")
        os.kill(pids[busy], signal.SIGKILL)
        events = [line[6:] for line in lines if line.startswith("data: ")]
        r = whole.result(timeout=30)
    throttle(next(a for name, a in actors.items() if name != busy), 0)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert (error["code"], error["type"]) == ("engine_error", "server_error")
    assert "replica" in error["message"]
    assert all("choices" in json.loads(e) for e in events[:-2])  # text, then the error
    check_error(r, 500)
    assert r.json()["error"]["code"] == "engine_error"
    # New requests, the dead replica's prefix included, are answered by the live replica.
    c = client(ray_url)
    for prompt in [body["prompt"], "Once upon", "Hello there", "A long story about the sea."]:
        out = c.completions.create(model=NAME, prompt=prompt, max_tokens=4, temperature=0)
        assert out.usage.completion_tokens == 4
    # Ray Serve replaces the dead replica: a new actor in a new process.
    replaced = wait_for(
        lambda: (names := set(engine_replicas())) - set(actors) and len(names) == 2 and names,
        60,
        "the dead replica was not replaced",
    )
    new = engine_replicas()[next(iter(replaced - set(actors)))]
    assert pid_of(new) != pids[busy]
    assert busy not in replaced
    # A conversation after the replacement follows its cache again.
    messages = [{"role": "user", "content": "Tell me about rivers and lakes. " * 4}]
    first = c.chat.completions.create(model=NAME, messages=messages, max_tokens=6, temperature=0)
    messages += [{"role": "assistant", "content": first.choices[0].message.content}]
    messages += [{"role": "user", "content": "More."}]
    stats_pulled()
    second = c.chat.completions.create(model=NAME, messages=messages, max_tokens=6, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= full_blocks(first.usage.prompt_tokens) > 0
