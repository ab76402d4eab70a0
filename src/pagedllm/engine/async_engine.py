"""AsyncLLMEngine: one background thread drives LLMEngine.step() for asyncio consumers.

Every engine call (add_request, abort, step, and any `call(fn)`) runs on that one thread,
so the engine needs no locks. Consumers hand it commands and get results back through
`loop.call_soon_threadsafe`; the requests submitted together (one, or the prompts of one
HTTP request) stream their RequestOutputs (of the kind each one's params ask for:
cumulative, deltas or the final one only) into one asyncio queue. The thread
sleeps on a condition while there is nothing to do. A failure is contained: requests
whose add or delivery raises fail alone, and so do those the engine's step reports
failed (`RequestOutput.error`); only if step() itself raises does every request fail.
`max_waiting` bounds the backlog: the waiting requests beyond what the engine could
admit now (`EngineSnapshot.backlog`); every request of a group counts, and a group that
would take the backlog past it is refused whole. `snapshot` is the engine's snapshot after the
loop's latest iteration, safe to read from any thread. For a graceful shutdown, `drain`
refuses new requests and `end_unfinished` ends the running ones (EngineStoppedError),
freeing their blocks.

Grammars (structured output) are compiled before a request is handed to that thread, on
threads of their own that only wait for the compiler's worker processes: a compile takes
milliseconds to seconds (up to the compiler's bound), which no running stream must wait
for. The engine gets the compiled grammar with the request and never compiles one.

`AsyncLLMEngine.build` constructs the engine on that thread too, so that one thread does
all the torch work: libgomp keeps a team of worker threads for every thread that ever ran
a parallel region, and once the teams outnumber the cores their workers stop spinning
between regions (measured on 2 cores: a 26 ms decode step took 33 ms on a second thread).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pagedllm.engine.config import EngineConfig
from pagedllm.engine.engine_client import PromptRequest, T
from pagedllm.engine.kv_recorder import KVRecorder, Record, Sink
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.outputs import RequestOutput
from pagedllm.engine.request_stream import RequestStream, deliver
from pagedllm.engine.snapshot import EngineSnapshot
from pagedllm.errors import EngineOverloadedError, EngineStoppedError, RequestFailedError
from pagedllm.lora import LoRARequest
from pagedllm.sampling_params import SamplingParams
from pagedllm.validation import check_int

logger = logging.getLogger("pagedllm")
# Requests waiting for their grammar at once; more queue for a thread. The compiles
# themselves are capped lower, by the compiler (structured/compile_pool.py).
GRAMMAR_WAITERS = 8


class AsyncLLMEngine:
    """An EngineClient (engine/engine_client.py) over an LLMEngine in this process; a
    LocalEngineClient too (the KV view's source, `max_waiting`)."""

    snapshot: EngineSnapshot
    max_waiting: int | None

    def __init__(self, engine: LLMEngine, max_waiting: int | None = None) -> None:
        _check_max_waiting(max_waiting)
        self.engine = engine
        self.max_waiting = max_waiting
        self.num_iterations = 0  # loop wake-ups that did work: stays put while idle
        self._cond = threading.Condition()
        self._commands: deque[Callable[[], None]] = deque()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._thread: threading.Thread | None = None
        self._stopping = False
        # While True the loop runs commands but never steps: the tests set it (under
        # `_cond`) to hold requests where they are.
        self._paused = False
        self._grammar_threads: ThreadPoolExecutor | None = None  # started at first use
        self._draining = False
        self.snapshot = engine.snapshot()

    @classmethod
    def build(
        cls, make_engine: Callable[[], LLMEngine], max_waiting: int | None = None
    ) -> AsyncLLMEngine:
        """Build the engine with `make_engine()` on a new loop thread, which then runs the
        loop; returns once it is built (or raises what building raised)."""
        _check_max_waiting(max_waiting)  # before a model is loaded for nothing
        built: queue.SimpleQueue[AsyncLLMEngine | BaseException] = queue.SimpleQueue()

        def run() -> None:
            try:
                engine = cls(make_engine(), max_waiting)
            except BaseException as exc:
                built.put(exc)
                return
            with engine._cond:
                engine._thread = threading.current_thread()
            built.put(engine)
            engine._loop()

        threading.Thread(target=run, name="pagedllm-engine", daemon=True).start()
        result = built.get()
        if isinstance(result, BaseException):
            raise result
        return result

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def healthy(self) -> bool:  # False once the loop thread died without being shut down
        return self._thread is None or self._thread.is_alive()

    def start(self) -> None:
        with self._cond:
            if self._thread is not None:
                return
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="pagedllm-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the loop; unfinished requests are aborted and their consumers fail."""
        with self._cond:
            thread, self._stopping = self._thread, True
            self._cond.notify_all()
        if thread is not None:
            thread.join(timeout)
        self._thread = None
        if self._grammar_threads is not None:
            self._grammar_threads.shutdown(wait=False, cancel_futures=True)
            self._grammar_threads = None

    def drain(self) -> None:
        """Admit no new request from now on (add_requests raises EngineStoppedError); the
        requests already added run on."""
        self._draining = True

    def end_unfinished(self, reason: str) -> None:
        """End every unfinished request with EngineStoppedError(reason), from any thread:
        its consumer gets the error, and its blocks are freed before the next step."""
        error = EngineStoppedError(reason)

        def run() -> None:
            for request_id in self._everyone():
                self._fail(request_id, error)

        self._submit(run)

    async def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the engine thread, after every command submitted before it."""
        self.start()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def run() -> None:
            try:
                result: Any = fn()
            except BaseException as exc:
                loop.call_soon_threadsafe(_resolve, future, None, exc)
            else:
                loop.call_soon_threadsafe(_resolve, future, result, None)

        self._submit(run)
        return await future

    def record_kv(self, sink: Sink, *, text: bool = False) -> KVRecorder:
        """LLMEngine.record_kv, on the engine thread only (inside `call`): a recorder
        handing `sink` a record per step from now on; `close()` it there too."""
        self._check_engine_thread("record_kv")
        return self.engine.record_kv(sink, text=text)

    def kv_snapshot(self, *, text: bool = False) -> Record:
        """LLMEngine.kv_snapshot, on the engine thread only (inside `call`)."""
        self._check_engine_thread("kv_snapshot")
        return self.engine.kv_snapshot(text=text)

    async def snapshot_now(self, *, cached_hashes: bool = False) -> EngineSnapshot:
        """The engine's snapshot taken on its thread after every command before it (not the
        last step's, as `snapshot`); `cached_hashes`: with the prefix cache's block hashes."""
        return await self.call(lambda: self.engine.snapshot(cached_hashes=cached_hashes))

    def _check_engine_thread(self, name: str) -> None:
        """RuntimeError unless called on the loop's thread or with no loop running: the
        engine is read without locks, so from its own thread alone."""
        thread = self._thread
        if thread is not None and thread.is_alive() and thread is not threading.current_thread():
            raise RuntimeError(f"{name} runs on the engine thread: call it inside `call`")

    async def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Queue a request and return its stream; see `add_requests`."""
        return await self.add_requests(
            [(request_id, prompt, params)], arrival_time, lora_request=lora_request
        )

    async def add_requests(
        self,
        requests: Sequence[PromptRequest],
        arrival_time: float | None = None,
        grammar_param: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Queue (request id, prompt, params) requests together, all or none, under the
        adapter `lora_request` (None: the base model), and return one stream of their
        outputs. Raises InvalidParameterError (a bad or oversized
        request; a grammar that cannot be compiled names `grammar_param`, default
        `structured_outputs.<kind>`), EngineOverloadedError (the backlog is at
        `max_waiting`, or these requests would take it past; or the grammar compiler has
        no room) or EngineStoppedError (draining: see `drain`).

        Pass token ids to keep tokenization off the engine thread: a text prompt is
        tokenized on it, and every running request waits meanwhile. Grammars are
        compiled first, off it (`_grammars`), after the checks that cost next to nothing
        (token ids, context, `n`, KV fit, draining, the backlog as of the last step): a
        request that could never run, or that would be refused now, is refused before its
        grammar compiles."""
        if not requests:
            raise ValueError("add_requests needs at least one request")
        for _, prompt, params in requests:
            if not isinstance(prompt, str):  # text is checked once tokenized, at add
                self.engine.check_request(prompt, params)
        self._check_room(self.snapshot.backlog)  # as of the last step: before any compile
        grammars = await self._grammars([params for _, _, params in requests], grammar_param)
        stream = RequestStream(self.abort, [request_id for request_id, _, _ in requests])

        def add() -> None:
            self._check_room(self.engine.snapshot().backlog)
            limit = self.max_waiting
            added: list[str] = []
            try:
                for (request_id, prompt, params), grammar in zip(requests, grammars, strict=True):
                    self.engine.add_request(
                        request_id, prompt, params, arrival_time, grammar, lora_request
                    )
                    added.append(request_id)
                # Every request of a group counts: queued, they must leave the backlog
                # within the limit, or none of them stays.
                if limit is not None and (backlog := self.engine.snapshot().backlog) > limit:
                    raise EngineOverloadedError(
                        f"the server is overloaded: these {len(requests)} requests would leave "
                        f"{backlog} waiting beyond what the engine can admit "
                        f"(max_waiting={limit}); retry later"
                    )
            except BaseException:
                for request_id in added:
                    self.engine.abort(request_id)
                raise
            for request_id in added:
                self._streams[request_id] = stream

        try:
            await self.call(add)
        except asyncio.CancelledError:
            stream.abort()  # they may have been added after all
            raise
        return stream

    async def check_lora(self, lora_request: LoRARequest) -> None:
        """LLMEngine.check_lora on the engine thread (it reads the adapter's files)."""
        await self.call(lambda: self.engine.check_lora(lora_request))

    async def remove_lora(self, lora_int_id: int) -> bool:
        """LLMEngine.remove_lora on the engine thread: requests running under the
        adapter finish under it; the id is never served again."""
        return await self.call(lambda: self.engine.remove_lora(lora_int_id))

    def _check_room(self, backlog: int) -> None:
        """EngineStoppedError while draining; EngineOverloadedError if `backlog` requests
        already wait beyond what the engine can admit and that is `max_waiting` or more."""
        if self._draining:
            raise EngineStoppedError("the engine is shutting down: it takes no new request")
        limit = self.max_waiting
        if limit is not None and backlog >= limit:
            raise EngineOverloadedError(
                f"the server is overloaded: {backlog} requests are waiting beyond what "
                f"the engine can admit (max_waiting={limit}); retry later"
            )

    async def _grammars(self, params: Sequence[SamplingParams], param: str | None) -> list[Any]:
        """Each request's compiled grammar (None without structured output), compiled on
        a grammar thread, once for requests that share their params (a batch's prompts).
        InvalidParameterError naming `param` if one cannot be compiled,
        EngineOverloadedError if the compiler has no room."""
        compiled: dict[int, Any] = {}  # id(spec) -> its grammar
        for p in params:
            spec = p.structured_outputs if isinstance(p, SamplingParams) else None
            if spec is not None and id(spec) not in compiled:
                if self._grammar_threads is None:
                    self._grammar_threads = ThreadPoolExecutor(
                        max_workers=GRAMMAR_WAITERS, thread_name_prefix="pagedllm-grammar-wait"
                    )
                compiled[id(spec)] = await asyncio.get_running_loop().run_in_executor(
                    self._grammar_threads, self.engine.compile_grammar, spec, param
                )
        return [
            compiled.get(id(p.structured_outputs)) if isinstance(p, SamplingParams) else None
            for p in params
        ]

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread; its blocks are freed before the next step."""

        def run() -> None:
            self._streams.pop(request_id, None)
            self.engine.abort(request_id)

        self._submit(run)

    def _submit(self, command: Callable[[], None]) -> None:
        with self._cond:
            self._commands.append(command)
            self._cond.notify()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._stopping or self._commands) and (
                    self._paused or not self.engine.has_unfinished_requests()
                ):
                    self._cond.wait()
                if self._stopping:
                    break
                commands = list(self._commands)
                self._commands.clear()
                paused = self._paused
            self.num_iterations += 1
            self._run(commands)
            if not paused and self.engine.has_unfinished_requests():
                self._step()
            self.snapshot = self.engine.snapshot()
        self._fail_all(EngineStoppedError("the engine was shut down"))

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            # The step contains its requests' failures (they come back as outputs with
            # `error`): one that escapes is a fault of the engine itself, and no request
            # can be trusted to go on.
            logger.exception("engine step failed; failing every request")
            error = RequestFailedError(f"the engine failed: {exc}")
            for request_id in self._everyone():
                self._fail(request_id, error)
            return
        # One hand-off per consumer loop and step, not one per request: at 64 streams
        # that is one wake-up of the event loop instead of 64.
        batches: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput]]] = {}
        for out in outputs:
            if out.error is not None:  # the engine aborted it already
                self._fail(out.request_id, RequestFailedError(f"the engine failed: {out.error}"))
                continue
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            batches.setdefault(stream.loop, []).append((stream, out))
            if out.finished:
                del self._streams[out.request_id]
        for loop, batch in batches.items():
            try:
                loop.call_soon_threadsafe(deliver, batch)
            except Exception as exc:  # e.g. the consumer's event loop is gone
                for stream, out in batch:
                    self._streams[out.request_id] = stream
                    self._fail(out.request_id, exc)

    def _fail(self, request_id: str, error: BaseException) -> None:
        try:
            self.engine.abort(request_id)
        except Exception:
            logger.exception("aborting request %s failed", request_id)
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            with contextlib.suppress(Exception):  # the consumer's loop may be gone
                stream.put_threadsafe(error)

    @staticmethod
    def _run(commands: list[Callable[[], None]]) -> None:
        for command in commands:
            try:
                command()
            except Exception:  # commands report their own errors; never kill the loop
                logger.exception("engine command failed")

    def _fail_all(self, error: BaseException) -> None:
        with self._cond:  # run what was submitted (aborts, queries) before stopping
            commands = list(self._commands)
            self._commands.clear()
        self._run(commands)
        for request_id in self._everyone():
            self._fail(request_id, error)
        self.snapshot = self.engine.snapshot()

    def _everyone(self) -> list[str]:
        """Every request the loop knows of (streams, and the engine's), each once."""
        return list(dict.fromkeys([*self._streams, *self.engine.unfinished_request_ids()]))


def _check_max_waiting(max_waiting: int | None) -> None:
    if max_waiting is not None:
        check_int(max_waiting, "max_waiting", min=0)


def _resolve(future: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if not future.done():  # else the caller was cancelled
        future.set_exception(exc) if exc is not None else future.set_result(result)
