"""Both engines the server runs over provide EngineClient member for member: each method
with the protocol's parameters (names, kinds, resolved types, which have defaults) and a
return type that provides the protocol's own (the stream), each property as a property
or an annotated attribute of the protocol's type. No type checker is configured (and a
runtime_checkable isinstance check sees names alone): this test reads the signatures.
The server runs over a third client as well, and refuses over one that is not in this
process what needs the engine here (max_waiting, the KV view). The engine in this process
provides the KV view's protocols too (KVViewSource, LocalEngineClient), and their
engine-thread calls refuse another thread while its loop runs."""

from __future__ import annotations

import asyncio
import inspect
import typing
from collections.abc import Sequence
from typing import Any

import pytest
from starlette.testclient import TestClient

from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.engine.config import EngineConfig
from pagedllm.engine.engine_client import (
    EngineClient,
    KVRecording,
    KVViewSource,
    LocalEngineClient,
    OutputStream,
    PromptRequest,
)
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.snapshot import EngineSnapshot
from pagedllm.entrypoints.server.app import create_app, local_engine
from pagedllm.lora import LoRARequest
from pagedllm.worker.fake_runner import FakeModelRunner
from pagedllm.worker.runner import ModelSpec

PROTOCOLS = (EngineClient, OutputStream, KVRecording)


def protocol_members(protocol: type) -> list[str]:
    """The methods and properties the protocol's body declares (typing adds two hooks)."""
    declared = [
        name
        for name, value in vars(protocol).items()
        if (inspect.isfunction(value) or isinstance(value, property))
        and name not in ("__init__", "__subclasshook__")
    ]
    return sorted({*declared, *protocol.__annotations__})


def value_type(cls: type, name: str) -> Any:
    """The type a property or annotated attribute `name` of `cls` holds."""
    member = inspect.getattr_static(cls, name, None)
    if isinstance(member, property):
        return typing.get_type_hints(member.fget)["return"]
    hints = typing.get_type_hints(cls)
    assert name in hints, f"{cls.__name__} has no property or annotated attribute {name}"
    return hints[name]


def assert_provides(cls: type, protocol: type) -> None:
    for name in protocol_members(protocol):
        wanted = inspect.getattr_static(protocol, name, None)
        if wanted is None or isinstance(wanted, property):
            assert value_type(cls, name) == value_type(protocol, name), (cls, name)
            continue
        member = inspect.getattr_static(cls, name, None)
        assert callable(member), f"{cls.__name__}.{name} is not a method"
        assert inspect.iscoroutinefunction(member) == inspect.iscoroutinefunction(wanted), name
        have, want = inspect.signature(member), inspect.signature(wanted)
        have_types, want_types = typing.get_type_hints(member), typing.get_type_hints(wanted)
        assert [(p.name, p.kind, p.default is p.empty) for p in have.parameters.values()] == [
            (p.name, p.kind, p.default is p.empty) for p in want.parameters.values()
        ], f"{cls.__name__}.{name}{have} against {want}"
        for param in want.parameters:
            assert have_types.get(param) == want_types.get(param), (cls, name, param)
        returned, promised = have_types["return"], want_types["return"]
        if promised in PROTOCOLS:
            assert_provides(returned, promised)
        elif returned != promised and typing.get_origin(promised) is None:
            assert issubclass(returned, promised), (cls, name, returned, promised)


def remote_engine() -> type:
    pytest.importorskip("ray.serve")
    from pagedllm.entrypoints.ray_serve.remote_engine import RemoteEngine

    return RemoteEngine


@pytest.mark.parametrize("engine", [lambda: AsyncLLMEngine, remote_engine], ids=["local", "ray"])
def test_the_engine_provides_the_client_protocol(engine: Any) -> None:
    assert_provides(engine(), EngineClient)


@pytest.mark.parametrize("protocol", [KVViewSource, LocalEngineClient])
def test_the_engine_in_this_process_provides_the_kv_view_protocols(protocol: type) -> None:
    assert_provides(AsyncLLMEngine, protocol)


def test_the_remote_engine_is_no_kv_view_source() -> None:
    assert issubclass(AsyncLLMEngine, KVViewSource)
    assert not issubclass(remote_engine(), KVViewSource)


def fake_engine() -> AsyncLLMEngine:
    config = EngineConfig(num_kv_blocks=16, block_size=4, max_num_seqs=4)
    return AsyncLLMEngine(LLMEngine(config, runner=FakeModelRunner(ModelSpec(100, 512, (0,)))))


def test_the_kv_view_calls_run_on_the_engine_thread_alone() -> None:
    engine = fake_engine()
    assert local_engine(engine) is engine and isinstance(engine, KVViewSource)
    records: list[Any] = []

    async def main() -> tuple[Any, Any, EngineSnapshot]:
        def attach() -> tuple[Any, Any]:
            recorder = engine.record_kv(records.append)
            return recorder, recorder.snapshot()

        recorder, picture = await engine.call(attach)
        with pytest.raises(RuntimeError, match="inside `call`"):
            engine.kv_snapshot()  # this thread is not the running loop's
        with pytest.raises(RuntimeError, match="inside `call`"):
            engine.record_kv(records.append)
        await engine.call(recorder.close)
        plain = await engine.call(lambda: engine.kv_snapshot(text=False))
        return picture, plain, await engine.snapshot_now(cached_hashes=True)

    try:
        recorded, plain, snap = asyncio.run(main())
    finally:
        engine.shutdown()
    assert recorded["step"] == plain["step"] == 0
    assert recorded["pool"] == plain["pool"]
    assert (snap.num_running, snap.cached_hashes) == (0, frozenset())


def test_the_check_sees_a_parameter_that_differs() -> None:
    class Renamed:
        async def add_requests(  # `requests` renamed
            self, batch: Any, arrival_time: float | None = None, grammar_param: str | None = None
        ) -> Any: ...

    with pytest.raises(AssertionError, match="add_requests"):
        assert_provides(Renamed, EngineClient)


class StandInClient:
    """An engine client that is neither of the two: the server needs nothing else."""

    def __init__(self) -> None:
        self.started = self.stopped = False

    @property
    def config(self) -> EngineConfig:
        return EngineConfig(model="/models/stand-in.gguf")

    @property
    def tokenizer(self) -> Any:
        return None

    @property
    def max_model_len(self) -> int:
        return 321

    @property
    def snapshot(self) -> EngineSnapshot:
        raise AssertionError("not read by these routes")

    @property
    def healthy(self) -> bool:
        return True

    def start(self) -> None:
        self.started = True

    def shutdown(self, timeout: float | None = 30.0) -> None:
        self.stopped = True

    async def add_requests(
        self,
        requests: Sequence[PromptRequest],
        arrival_time: float | None = None,
        grammar_param: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> OutputStream:
        raise AssertionError("not sent by these routes")

    async def check_lora(self, lora_request: LoRARequest) -> None:
        raise AssertionError("no adapters here")

    async def remove_lora(self, lora_int_id: int) -> bool:
        raise AssertionError("no adapters here")


def test_the_server_runs_over_any_engine_client() -> None:
    assert_provides(StandInClient, EngineClient)
    client = StandInClient()
    with TestClient(create_app(client, kv_view=False)) as http:
        (card,) = http.get("/v1/models").json()["data"]
        assert (card["id"], card["max_model_len"]) == ("stand-in", 321)
        assert http.get("/health").json() == {"status": "ok"}
        assert client.started
    assert client.stopped


@pytest.mark.parametrize("options", [{}, {"kv_view": False, "max_waiting": 4}])
def test_what_needs_an_engine_in_this_process_is_refused_over_another(
    options: dict[str, Any],
) -> None:
    with pytest.raises(ValueError, match="need an engine in this process"):
        create_app(StandInClient(), **options)
