"""PrefixAwareRouter on its own (no Ray cluster): the longest cached prefix wins; stats
that are missing, failing or malformed leave routing to load, without an exception; a
replica that dies or leaves the set takes the router's state for it along. The replicas
are stand-ins with the attributes Ray Serve's RunningReplica gives a router."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytest.importorskip("ray.serve")

from ray.serve._private.common import (
    DeploymentHandleSource,
    DeploymentID,
    ReplicaID,
    RequestMetadata,
)
from ray.serve.request_router import PendingRequest

from inspect_internals import known_replicas
from pagedllm.entrypoints.ray_serve.prefix_router import (
    PrefixAwareRouter,
    prompt_block_hashes,
)
from pagedllm.lora import LoRARequest
from pagedllm.sampling_params import SamplingParams

DEPLOYMENT = DeploymentID(name="EngineReplica", app_name="test")
BLOCK = 4
PROMPT = list(range(100, 121))  # 21 tokens: 5 full blocks the engine could reuse


class StandInReplica:
    """What the router reads of a replica: its id, its routing stats and its capacity."""

    def __init__(self, name: str, stats: Any = None, fail: bool = False) -> None:
        self.replica_id = ReplicaID(unique_id=name, deployment_id=DEPLOYMENT)
        self.stats = {} if stats is None else stats
        self.fail = fail
        self.max_ongoing_requests = 256

    @property
    def routing_stats(self) -> Any:
        if self.fail:
            raise RuntimeError("the stats could not be fetched")
        return self.stats

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return 0


def new_router(**kwargs: Any) -> PrefixAwareRouter:
    router = PrefixAwareRouter(
        DEPLOYMENT, DeploymentHandleSource.UNKNOWN, use_replica_queue_len_cache=True
    )
    router.initialize_state(block_size=BLOCK, **kwargs)
    return router


def pending(tokens: list[int], lora: LoRARequest | None = None) -> PendingRequest:
    """A `generate(requests, arrival_time, grammar_param, lora_request)` call as the
    ingress makes it (made in a loop: it holds a future)."""
    metadata = RequestMetadata(request_id="r0", internal_request_id="r0", call_method="generate")
    return PendingRequest(
        args=[[("r0", tokens, SamplingParams())], None, None, lora], kwargs={}, metadata=metadata
    )


def choose(
    router: PrefixAwareRouter,
    replicas: list[StandInReplica],
    tokens: Any,
    lora: LoRARequest | None = None,
) -> list:
    async def route() -> list:
        return await router.choose_replicas(replicas, pending(tokens, lora))  # type: ignore[arg-type]

    ranks = asyncio.run(route())
    return [[r.replica_id.unique_id for r in rank] for rank in ranks]


def test_the_longest_cached_prefix_wins_within_the_imbalance() -> None:
    hashes = prompt_block_hashes(PROMPT, BLOCK)
    assert len(hashes) == 5
    a = StandInReplica("a", {"cached": hashes[:2]})
    b = StandInReplica("b", {"cached": hashes[:4]})
    c = StandInReplica("c", {"cached": []})
    router = new_router(max_imbalance=2)
    assert choose(router, [a, b, c], PROMPT) == [["b"], ["a", "c"]]
    router.on_new_queue_len_info(b.replica_id, 3)  # 3 more than the least loaded: too busy
    assert choose(router, [a, b, c], PROMPT) == [["a"], ["c", "b"]]
    assert (router.num_prefix_routed, router.num_balanced) == (1, 1)


def test_prefixes_are_matched_under_their_adapter() -> None:
    """A prefix cached under an adapter draws requests under that adapter only (the
    engine's prefix cache is keyed by adapter), and the base's prefix does not draw them."""
    base = StandInReplica("base", {"cached": prompt_block_hashes(PROMPT, BLOCK)})
    tuned = StandInReplica("tuned", {"cached": prompt_block_hashes(PROMPT, BLOCK, lora_id=3)})
    idle = StandInReplica("idle", {"cached": []})
    router = new_router(max_imbalance=2)
    lora = LoRARequest("sql", 3, "/adapters/sql")
    assert choose(router, [idle, base, tuned], PROMPT, lora)[0] == ["tuned"]
    assert choose(router, [idle, base, tuned], PROMPT)[0] == ["base"]
    other = LoRARequest("chat", 4, "/adapters/chat")
    assert choose(new_router(), [idle, base, tuned], PROMPT, other)[0] == ["idle"]


@pytest.mark.parametrize(
    "stats",
    [
        {},  # no report yet
        {"cached": None, "running": "many"},  # malformed
        {"cached": 5},  # not a collection
        {"cached": ["not bytes", 7]},
    ],
)
def test_missing_or_malformed_stats_route_by_load(stats: dict[str, Any]) -> None:
    replicas = [StandInReplica(name, dict(stats)) for name in "abc"]
    router = new_router()
    for replica, load in zip(replicas, (5, 1, 3), strict=True):
        router.on_new_queue_len_info(replica.replica_id, load)
    assert choose(router, replicas, PROMPT) == [["b"], ["c", "a"]]


def test_stats_that_fail_to_load_route_by_load() -> None:
    hashes = prompt_block_hashes(PROMPT, BLOCK)
    broken = StandInReplica("a", {"cached": hashes}, fail=True)  # would match, if readable
    idle = StandInReplica("b")
    router = new_router()
    router.on_new_queue_len_info(broken.replica_id, 2)
    router.on_new_queue_len_info(idle.replica_id, 0)
    assert choose(router, [broken, idle], PROMPT) == [["b"], ["a"]]
    # Without the queue-length cache either, every load counts as 0: still a choice.
    assert choose(new_router(), [broken, idle], PROMPT)[0] in (["a"], ["b"])
    # A request without a prompt (e.g. `info()`): least loaded first.
    ranks = asyncio.run(router.choose_replicas([broken, idle], None))  # type: ignore[arg-type]
    assert [r.replica_id.unique_id for r in ranks[0]] == ["b", "a"]


def test_a_dead_replica_takes_its_state_along() -> None:
    hashes = prompt_block_hashes(PROMPT, BLOCK)
    a, b = StandInReplica("a", {"cached": hashes}), StandInReplica("b")
    router = new_router()

    async def scenario() -> list[list[str]]:
        router.update_replicas([a, b])  # type: ignore[list-item]
        first = await router.choose_replicas([a, b], pending(PROMPT))  # type: ignore[list-item]
        assert first[0][0] is a  # and the router remembers the prompt went to `a`
        assert known_replicas(router) == {a.replica_id, b.replica_id}
        router.on_replica_actor_died(a.replica_id)
        assert known_replicas(router) == {b.replica_id}
        assert set(router.curr_replicas) == {b.replica_id}
        # Ray Serve brings up a replacement: a new replica id, known from its own stats.
        new = StandInReplica("a2", {"cached": hashes[:3]})
        router.update_replicas([b, new])  # type: ignore[list-item]
        ranks = await router.choose_replicas([b, new], pending(PROMPT))  # type: ignore[list-item]
        return [[r.replica_id.unique_id for r in rank] for rank in ranks]

    assert asyncio.run(scenario()) == [["a2"], ["b"]]
    assert known_replicas(router) == {b.replica_id, ReplicaID("a2", DEPLOYMENT)}


def test_a_replica_leaving_the_set_is_forgotten() -> None:
    hashes = prompt_block_hashes(PROMPT, BLOCK)
    a, b = StandInReplica("a", {"cached": hashes}), StandInReplica("b")
    router = new_router()

    async def scenario() -> None:
        router.update_replicas([a, b])  # type: ignore[list-item]
        await router.choose_replicas([a, b], pending(PROMPT))  # type: ignore[list-item]
        router.update_replicas([b])  # type: ignore[list-item]  # scaled down, or replaced

    asyncio.run(scenario())
    assert known_replicas(router) == {b.replica_id}  # its (empty) stats set stays
    assert len(router._recent) == 0  # the prompt's blocks had gone to `a`


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("windows", [None, (5, None, 5)], ids=["one group", "hybrid"])
def test_the_routers_hashes_are_the_engines(
    block_size: int, windows: tuple[int | None, ...] | None
) -> None:
    """The router hashes a prompt exactly as the engine's prefix cache does: after a
    request, the engine's cached hashes (what a replica reports) are the router's hashes of
    the next turn's prompt (this one and its reply), no more, no fewer."""
    from pagedllm.engine.config import EngineConfig
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.worker.fake_runner import FakeModelRunner
    from pagedllm.worker.runner import ModelSpec

    spec = ModelSpec(1000, 4096, (0,), num_layers=len(windows or (None,)), layer_windows=windows)
    config = EngineConfig(block_size=block_size, num_kv_blocks=256, max_model_len=512)
    engine = LLMEngine(config, runner=FakeModelRunner(spec, seed=0))
    prompt = [(7 * i) % 997 + 1 for i in range(45)]  # 2 full blocks of 16 and 13 tokens
    engine.add_request("r", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    reply = list(outputs[-1].outputs[0].token_ids)
    cached = engine.snapshot(cached_hashes=True).cached_hashes
    assert cached == set(prompt_block_hashes(prompt + reply, block_size))
    assert len(cached) == (45 if block_size == 1 else 2)
