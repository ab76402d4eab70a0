"""EngineClient: what the OpenAI server needs of an engine, wherever the engine runs.

Two classes provide it: AsyncLLMEngine (the engine in this process, on its loop thread)
and RemoteEngine (engine replicas behind a Ray Serve handle). The server is written
against this protocol alone. What only an engine in this process can do has protocols
of its own that AsyncLLMEngine provides and RemoteEngine does not: KVViewSource (the KV
view's records and pictures) and LocalEngineClient (with the backlog bound); drain at
shutdown still takes an AsyncLLMEngine by name.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

from pagedllm.engine.config import EngineConfig
from pagedllm.engine.kv_recorder import Record, Sink
from pagedllm.engine.outputs import RequestOutput
from pagedllm.engine.snapshot import EngineSnapshot
from pagedllm.lora import LoRARequest
from pagedllm.sampling_params import SamplingParams

# (request id, prompt as text or token ids, its sampling parameters)
PromptRequest = tuple[str, str | Sequence[int], SamplingParams]
T = TypeVar("T")


class OutputStream(Protocol):
    """The outputs of requests queued together, in arrival order, until all finished."""

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...

    async def __anext__(self) -> RequestOutput: ...

    def abort(self) -> None:
        """Abort every request of the stream that has not finished."""


class EngineClient(Protocol):
    @property
    def config(self) -> EngineConfig: ...

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (None for an engine over token ids alone)."""

    @property
    def max_model_len(self) -> int: ...

    @property
    def snapshot(self) -> EngineSnapshot:
        """The engine's latest figures (all replicas' added up), for /metrics."""

    @property
    def healthy(self) -> bool:
        """False once the engine can serve no request any more."""

    def start(self) -> None: ...

    def shutdown(self, timeout: float | None = 30.0) -> None: ...

    async def add_requests(
        self,
        requests: Sequence[PromptRequest],
        arrival_time: float | None = None,
        grammar_param: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> OutputStream:
        """Queue the requests together, all or none, under the adapter `lora_request`
        (None: the base model), and return one stream of their outputs. Raises
        InvalidParameterError (a bad request; a grammar that cannot be compiled names
        `grammar_param`), EngineOverloadedError or EngineStoppedError."""

    async def check_lora(self, lora_request: LoRARequest) -> None:
        """InvalidParameterError (naming the field or tensor) if requests could not run
        under this adapter: LLMEngine.check_lora."""

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Forget the adapter: requests running under it finish, its id is never served
        again (LLMEngine.remove_lora). False if the engine did not know it."""


class KVRecording(Protocol):
    """A KV recorder (engine/kv_recorder.py) attached to an engine; engine thread only."""

    def snapshot(self) -> Record:
        """Hand the sink what is pending, then the whole picture as of the records handed."""

    def close(self) -> None:
        """Stop recording (what is pending is handed to the sink first)."""


@runtime_checkable
class KVViewSource(Protocol):
    """What the server's KV view needs of an engine in this process. `record_kv` and
    `kv_snapshot` are plain calls made on the engine's thread, inside `call`: there no
    step runs, so a picture and the records handed to the sink around it are cut at one
    moment (the view's feed numbers its records there too). `isinstance` tells an engine
    that has them (by name, as runtime protocols check)."""

    async def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the engine's thread between steps, after every command before it."""

    def record_kv(self, sink: Sink, *, text: bool = False) -> KVRecording:
        """Engine thread only: record the KV events from now on, handing `sink` a record
        per step (`text`: each block's token text too)."""

    def kv_snapshot(self, *, text: bool = False) -> Record:
        """Engine thread only: the KV view's whole picture now (`text`: with token text)."""


class LocalEngineClient(EngineClient, KVViewSource, Protocol):
    """An engine client in this process: the KV view's source, with its backlog bound
    (`max_waiting`: the waiting requests beyond what the engine can admit; None: no bound)
    settable."""

    max_waiting: int | None
