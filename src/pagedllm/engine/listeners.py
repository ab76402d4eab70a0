"""StepListener: the one way to listen to an engine; `Listeners`, an engine's registry
of them, and the fan-out of the pool's hooks.

`LLMEngine.add_listener(listener)` registers a StepListener; the callable it returns
removes it. A listener hears each step begin and end (with the step's plain-data
schedule, its outputs and an EngineSnapshot of the engine as the step ran) and each
abort. One that sets `wants_kv_events` also gets the block manager's and allocator's
hooks (kv/events.py); the engine installs them only while such a listener exists, so an
unwatched engine pays one attribute test per bookkeeping operation. Every call comes on
the engine's thread and must not block.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.engine.outputs import RequestOutput
from pagedllm.engine.snapshot import EngineSnapshot
from pagedllm.kv.events import KVListener, TableView
from pagedllm.kv.manager import KVCacheManager


class StepListener:
    """Override what you need; every hook does nothing by default."""

    wants_kv_events = False  # True: also a KVListener (kv/events.py) of the block manager

    def on_step_begin(self, step_number: int) -> None:
        """Step `step_number` (counting from 1) is about to be scheduled."""

    def on_step_end(
        self, step: SchedulerOutput, outputs: Sequence[RequestOutput], ran: EngineSnapshot
    ) -> None:
        """The step ran. `ran`: the engine as the step ran, its tokens computed, before
        the sequences that finished in it let go of their blocks."""

    def on_abort(self, request_id: str) -> None:
        """The request was aborted (or failed) and its blocks freed."""


class KVHooks:
    """The block manager's one listener forwarding to several KV listeners, in order."""

    def __init__(self, listeners: Sequence[KVListener]) -> None:
        self.listeners = tuple(listeners)

    def on_cached(self, block: int) -> None:
        for listener in self.listeners:
            listener.on_cached(block)

    def on_evicted(self, block: int) -> None:
        for listener in self.listeners:
            listener.on_evicted(block)

    def on_cache_reset(self) -> None:
        for listener in self.listeners:
            listener.on_cache_reset()

    def on_adapter_loaded(self, lora_id: int, pages: tuple[int, ...]) -> None:
        for listener in self.listeners:
            listener.on_adapter_loaded(lora_id, pages)

    def on_adapter_evicted(self, lora_id: int, pages: tuple[int, ...]) -> None:
        for listener in self.listeners:
            listener.on_adapter_evicted(lora_id, pages)

    def on_admitted(self, seq_id: int, table: TableView, num_hits: int, group: int = 0) -> None:
        for listener in self.listeners:
            listener.on_admitted(seq_id, table, num_hits, group=group)

    def on_grown(
        self, seq_id: int, table: TableView, copies: list[tuple[int, int]], group: int = 0
    ) -> None:
        for listener in self.listeners:
            listener.on_grown(seq_id, table, copies, group=group)

    def on_forked(self, parent_id: int, child_id: int, table: TableView, group: int = 0) -> None:
        for listener in self.listeners:
            listener.on_forked(parent_id, child_id, table, group=group)

    def on_freed(self, seq_id: int, table: TableView, group: int = 0) -> None:
        for listener in self.listeners:
            listener.on_freed(seq_id, table, group=group)

    def on_dropped(
        self, seq_id: int, table: TableView, dropped: list[tuple[int, int]], group: int = 0
    ) -> None:
        for listener in self.listeners:
            listener.on_dropped(seq_id, table, dropped, group=group)

    def on_trimmed(
        self, seq_id: int, table: TableView, given_back: list[int], lookahead: int, group: int = 0
    ) -> None:
        for listener in self.listeners:
            listener.on_trimmed(seq_id, table, given_back, lookahead, group=group)


class Listeners:
    """An engine's listeners, called in the order they were added."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self._all: list[StepListener] = []

    def add(self, listener: StepListener) -> Callable[[], None]:
        """Register `listener`; returns the call that removes it."""
        self._all.append(listener)
        self._install_kv_hooks()

        def remove() -> None:
            if listener in self._all:
                self._all.remove(listener)
                self._install_kv_hooks()

        return remove

    def step_begin(self, step_number: int) -> None:
        for listener in self._all:
            listener.on_step_begin(step_number)

    def step_end(
        self, step: SchedulerOutput, outputs: Sequence[RequestOutput], ran: EngineSnapshot
    ) -> None:
        for listener in self._all:
            listener.on_step_end(step, outputs, ran)

    def abort(self, request_id: str) -> None:
        for listener in self._all:
            listener.on_abort(request_id)

    def _install_kv_hooks(self) -> None:
        # Installed only while someone listens: an unwatched pool tests one attribute.
        watching = [listener for listener in self._all if listener.wants_kv_events]
        hooks: Any = None
        if len(watching) == 1:
            hooks = watching[0]
        elif watching:
            hooks = KVHooks(watching)
        self.kv.set_listener(hooks)
