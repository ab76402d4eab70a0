"""Worker processes that compile grammars first, each killed when its compile runs past the
bound.

xgrammar cannot interrupt a compile, and a hostile grammar can take minutes. So a grammar
is compiled first in one of `size` worker processes (compile_worker.py), waited for at
most `timeout_s`: past that the worker is killed, which ends the compile and frees its
place, and a fresh worker takes it. A grammar the worker compiled in time is then compiled
again in this process, which is known to end in about the time the worker took: the same
work, and cheaper than carrying the compiled grammar across (xgrammar's JSON form of one
takes longer to write and read than the compile itself). At most `size` compiles run at
once, both halves included. A caller that finds every worker busy waits its turn (first
come, first served) for at most `timeout_s`, then gets EngineOverloadedError carrying the
real wait: the time until the first compile in flight reaches its bound (or, past its
worker, should be done).

Workers are forked from multiprocessing's fork server, which imports xgrammar once: a
fresh worker takes milliseconds rather than the seconds torch takes to import. Where there
is no fork server they are spawned.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections import deque
from collections.abc import Callable
from multiprocessing.context import BaseContext
from typing import TypeVar

from pagedllm.errors import EngineOverloadedError
from pagedllm.structured import compile_worker

T = TypeVar("T")
# A worker's start (the tokenizer's vocabulary read in) is not the grammar's doing: it is
# waited for apart from the compile's bound.
STARTUP_TIMEOUT_S = 120.0


class CompileRefusedError(Exception):
    """The grammar cannot be used: the reason, for the client."""


class CompilePool:
    def __init__(self, tokenizer_info: str, size: int, timeout_s: float) -> None:
        """`tokenizer_info`: the model's xgrammar TokenizerInfo, serialized."""
        self.timeout_s = timeout_s
        self._tokenizer_info = tokenizer_info
        self._context = _context()
        self._cond = threading.Condition()
        self._idle = [self._start() for _ in range(size)]  # started now, ready by first use
        self._waiting: deque[object] = deque()  # callers waiting for a worker, in order
        self._done_by: dict[object, float] = {}  # compile in flight -> when it should be done
        self._closed = False

    def compile(self, kind: str, text: str, build: Callable[[], T]) -> T:
        """`build()`, the compile in this process, once a worker has compiled (kind, text)
        within `timeout_s`. CompileRefusedError if the worker found it invalid or ran past
        the bound; EngineOverloadedError if no worker came free within `timeout_s`."""
        worker, job = self._take()
        outcome, reason = "died", ""  # until the worker answers
        try:
            worker.wait_ready()
            start = time.monotonic()
            with self._cond:
                self._done_by[job] = start + self.timeout_s
            outcome, reason = worker.run(kind, text, self.timeout_s)
            if outcome == "ok":
                with self._cond:  # `build` does the same work again
                    self._done_by[job] = 2 * time.monotonic() - start
                return build()
        finally:
            if outcome in ("timeout", "died"):
                worker.kill()
                worker = self._start()
            self._give_back(worker, job)
        if outcome == "timeout":
            raise CompileRefusedError(
                f"did not compile within {self.timeout_s:g} s; simplify it (fewer "
                "alternatives, bounded repetition, less nesting)"
            )
        if outcome == "died":
            raise CompileRefusedError("cannot be used: the grammar compiler failed on it")
        raise CompileRefusedError(f"cannot be used: {reason}")

    def close(self) -> None:
        """Stop every worker (a busy one as its compile returns)."""
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.kill()

    def _take(self) -> tuple[_Worker, object]:
        job = object()
        give_up = time.monotonic() + self.timeout_s
        with self._cond:
            self._waiting.append(job)
            try:
                while not (self._idle and self._waiting[0] is job):
                    left = give_up - time.monotonic()
                    if left <= 0:
                        raise EngineOverloadedError(
                            f"every grammar compiler has been busy for {self.timeout_s:g} s "
                            "(other requests' grammars): retry later",
                            retry_after_s=self._time_to_free(),
                        )
                    self._cond.wait(left)
                return self._idle.pop(), job
            finally:
                self._waiting.remove(job)
                self._cond.notify_all()  # the next in line may go

    def _give_back(self, worker: _Worker, job: object) -> None:
        with self._cond:
            self._done_by.pop(job, None)
            if self._closed:
                worker.kill()
                return
            self._idle.append(worker)
            self._cond.notify_all()

    def _time_to_free(self) -> float:
        """Seconds until the first compile in flight should be done and free its worker:
        at its bound, or, once its worker compiled it, as long again as that took."""
        if not self._done_by:
            return self.timeout_s
        return max(min(self._done_by.values()) - time.monotonic(), 0.0)

    def _start(self) -> _Worker:
        return _Worker(self._context, self._tokenizer_info)


class _Worker:
    """One worker process and the parent's end of its pipe."""

    def __init__(self, context: BaseContext, tokenizer_info: str) -> None:
        self.conn, child = context.Pipe()
        self.process = context.Process(  # type: ignore[attr-defined]
            target=compile_worker.main,
            args=(child, tokenizer_info),
            name="pagedllm-grammar-compiler",
            daemon=True,
        )
        self.process.start()
        child.close()
        self.ready = False

    def wait_ready(self) -> None:
        if self.ready:
            return
        if not self.conn.poll(STARTUP_TIMEOUT_S) or self.conn.recv() != compile_worker.READY:
            raise RuntimeError(
                f"a grammar compiler process did not start within {STARTUP_TIMEOUT_S:g} s"
            )
        self.ready = True

    def run(self, kind: str, text: str, timeout_s: float) -> tuple[str, str]:
        """("ok", ""), ("error", why), ("timeout", "") or ("died", "")."""
        try:
            self.conn.send((kind, text))
            if not self.conn.poll(timeout_s):
                return "timeout", ""
            outcome, value = self.conn.recv()
        except (EOFError, OSError):  # it died: a crash in the library, or killed
            return "died", ""
        return outcome, value

    def kill(self) -> None:
        self.process.kill()
        self.process.join()
        self.conn.close()


def _context() -> BaseContext:
    if "forkserver" in multiprocessing.get_all_start_methods():
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload([compile_worker.__name__])
        return context
    return multiprocessing.get_context("spawn")
