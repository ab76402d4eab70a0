"""KVFeed: the engine's KV records to any number of browsers, never making the engine wait.

The engine thread's only part is `_publish`: it puts a step's record in a ring (a dict
keyed by a running number, trimmed to `max_records` records and MAX_EVENTS events), a
few dict operations that take no lock and do not depend on any reader. Each SSE client
is a coroutine on the server's event loop that wakes every `interval` seconds and sends
ONE message: an `update` with the records it has not seen, or, when it fell behind (the
ring dropped records it had not read, or they hold more than MAX_EVENTS_PER_MESSAGE
events), a fresh `snapshot` instead: steps coalesce under load, and a slow reader costs
the server one message in flight and the engine nothing. Snapshots are built on the
engine thread between steps (`KVViewSource.call`), one at a time however many clients
ask, and the records after one continue it exactly.

The recorder is attached only while a client listens: the first subscriber attaches it,
the last one to leave detaches it (both on the engine thread), so an unwatched engine
runs with its listeners at None.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from pagedllm.engine.engine_client import KVRecording, KVViewSource
from pagedllm.engine.kv_recorder import Record

HEARTBEAT_S = 15.0  # an SSE comment now and then keeps proxies from closing an idle stream
# A stream ends after this long and the page opens a new one (a new token, a snapshot):
# uvicorn's graceful shutdown waits for open responses, and a stream that never ended
# would hold it up for good.
MAX_STREAM_S = 30.0
MAX_EVENTS = 50_000  # held in the ring, all records together
MAX_EVENTS_PER_MESSAGE = 5_000  # an update with more is a snapshot instead


class KVFeed:
    def __init__(
        self,
        engine: KVViewSource,
        *,
        text: bool = False,
        interval: float = 0.25,
        max_records: int = 2048,
    ) -> None:
        if not interval > 0:
            raise ValueError(f"interval must be > 0 seconds, got {interval}")
        self.engine = engine
        self.text = text
        self.interval = interval
        self.max_records = max_records
        self.subscribers = 0
        self._records: dict[int, Record] = {}
        self._tail = 0  # oldest record kept
        self._head = 0  # next record's number
        self._held_events = 0
        self._recorder: KVRecording | None = None  # engine thread only
        self._snapshot: asyncio.Future[tuple[Record, int]] | None = None
        self._tasks: set[asyncio.Future[Any]] = set()

    # ------------------------------------------------------- engine thread
    def _publish(self, record: Record) -> None:
        """The recorder's sink: never blocks, never waits for a reader."""
        self._records[self._head] = record
        self._held_events += len(record["ev"])
        self._head += 1  # after the insert: a reader never sees a number without its record
        while self._head - self._tail > self.max_records or (
            self._held_events > MAX_EVENTS and self._head - self._tail > 1
        ):
            self._held_events -= len(self._records.pop(self._tail)["ev"])
            self._tail += 1

    def _take_snapshot(self) -> tuple[Record, int]:
        """The picture now and the number of the first record after it (engine thread)."""
        if self.subscribers > 0 and self._recorder is None:
            self._recorder = self.engine.record_kv(self._publish, text=self.text)
        if self._recorder is not None:
            return self._recorder.snapshot(), self._head  # snapshot() publishes what is pending
        return self.engine.kv_snapshot(text=self.text), self._head

    def _detach_if_unwatched(self) -> None:
        if self.subscribers == 0 and self._recorder is not None:
            self._recorder.close()
            self._recorder = None
            self._records.clear()
            self._tail = self._head
            self._held_events = 0

    # ---------------------------------------------------------- event loop
    async def snapshot(self) -> tuple[Record, int]:
        """A snapshot taken on the engine thread; callers at the same time share one."""
        if self._snapshot is None:
            self._snapshot = asyncio.ensure_future(self.engine.call(self._take_snapshot))
            self._snapshot.add_done_callback(self._snapshot_done)
        return await asyncio.shield(self._snapshot)

    def _snapshot_done(self, future: asyncio.Future[tuple[Record, int]]) -> None:
        if self._snapshot is future:
            self._snapshot = None

    async def stream(self) -> AsyncIterator[str]:
        """The SSE messages of one subscriber, until it leaves (the generator is closed)."""
        self.subscribers += 1
        try:
            # Not the shared snapshot: this one must run after the count went up, so that
            # it attaches the recorder.
            snapshot, cursor = await self.engine.call(self._take_snapshot)
            yield self._message("snapshot", snapshot)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + MAX_STREAM_S
            idle = 0.0
            while True:
                await asyncio.sleep(self.interval)
                if loop.time() >= deadline:
                    yield "event: bye\ndata: {}\n\n"  # the page reconnects at once
                    return
                head = self._head
                if head == cursor:
                    idle += self.interval
                    if idle >= HEARTBEAT_S:
                        idle = 0.0
                        yield ": keep-alive\n\n"
                    continue
                idle = 0.0
                records = [self._records.get(n) for n in range(cursor, head)]
                if any(r is None for r in records) or (
                    sum(len(r["ev"]) for r in records if r) > MAX_EVENTS_PER_MESSAGE
                ):
                    # Behind: one snapshot instead, with the skipped steps' figures and notes.
                    start = cursor
                    snapshot, cursor = await self.snapshot()
                    skipped = [self._records.get(n) for n in range(start, cursor)]
                    summary = _summary([r for r in skipped if r is not None])
                    yield self._message("snapshot", {**snapshot, **summary})
                else:
                    cursor = head
                    yield self._message("update", {"records": records})
        finally:
            self.subscribers -= 1
            if self.subscribers == 0:
                self._detach_soon()

    def _detach_soon(self) -> None:
        """Detach on the engine thread; from a closing generator, so without waiting."""
        try:
            task = asyncio.ensure_future(self.engine.call(self._detach_if_unwatched))
        except RuntimeError:  # no running loop: the server is shutting down
            return
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _message(self, kind: str, data: Record) -> str:
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


def _summary(records: list[Record], max_points: int = 300, max_notes: int = 150) -> Record:
    """What a coalesced snapshot carries of the steps it skipped: their figures for the
    chart (at most `max_points`) and their latest events but the busiest kinds, for
    the log."""
    every = max(1, -(-len(records) // max_points))
    series = [[r["step"], r["st"]] for r in records[::every]]
    log: list[Record] = []
    count = 0
    for r in reversed(records):
        notes = [e for e in r["ev"] if not _busy(e)]
        if notes:
            log.append({"step": r["step"], "ev": notes[-(max_notes - count) :]})
            count += len(log[-1]["ev"])
        if count >= max_notes:
            break
    log.reverse()
    return {"series": series, "log": log}


def _busy(event: Record) -> bool:
    """One of the kinds every step brings many of: growing tables, text, cache entries,
    and checks of proposals that gave no block back."""
    kind = event["k"]
    return kind in ("append", "text", "cache") or (kind == "trim" and not event["blocks"])
