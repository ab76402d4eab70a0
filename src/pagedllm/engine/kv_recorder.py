"""KVRecorder: the engine's KV events, numbered by step, for the live view and for traces.

`LLMEngine.record_kv(sink)` makes one: a step listener (engine/listeners.py) that also
hears the block manager's and allocator's hooks (kv/events.py). It knows which request
each sequence serves, notes preemptions, finishes and aborts (each event with its kind's
fields in kv/events.py `EVENT_FIELDS`), and hands `sink` one record per step:
`{"step": n, "ev": [events], "st": {figures}}`. Events between two steps (an abort) go
out with the next step's start, under the number of the step before them.
Everything runs on the engine's thread and the sink must not block: the server's feed
drops the record in a bounded ring, a trace appends it to a list. `close()` stops it.

`engine_snapshot` is the whole picture at one moment (pool, tables, requests, figures),
with the token text of each block only when asked for.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.core.sequence import Request
from pagedllm.core.sequence import Sequence as Seq
from pagedllm.engine.listeners import StepListener
from pagedllm.engine.outputs import RequestOutput
from pagedllm.engine.snapshot import EngineSnapshot
from pagedllm.kv.events import Event, TableView
from pagedllm.kv.manager import KVCacheManager
from pagedllm.kv.pool_state import PoolState
from pagedllm.sampling_params import BeamSearchParams

Record = dict[str, Any]
Sink = Callable[[Record], None]


class KVRecorder(StepListener):
    wants_kv_events = True

    def __init__(
        self,
        scheduler: Scheduler,
        kv: KVCacheManager,
        sink: Sink,
        current: Callable[[], EngineSnapshot],
        *,
        tokenizer: Any = None,
        step: int = 0,
    ) -> None:
        """Built by `LLMEngine.record_kv`, which registers it. `current()`: the engine's
        snapshot now; `tokenizer`: record each block's token text too."""
        self.scheduler = scheduler
        self.kv = kv
        self.sink = sink
        self.current = current
        self.tokenizer = tokenizer
        self.step = step  # the step running now, or the last one between steps
        self.remove: Callable[[], None] | None = None  # set by the engine that registers it
        self._events: list[Event] = []
        self._owner: dict[int, str] = {}  # sequence id -> request id
        # What each table ((sequence, group)) was when last seen, to tell what a hook
        # changed; `_tokens` per sequence (its first group's), for the text mode.
        self._length: dict[tuple[int, int], int] = {}
        self._seen_tokens: dict[tuple[int, int], int] = {}
        self._tokens: dict[int, int] = {}
        self._text_from: dict[int, int] = {}  # text mode: first logical block to re-read
        self._seen(kv)

    def close(self) -> None:
        """Stop listening (pending events are published first)."""
        self.flush()
        if self.remove is not None:
            self.remove()
            self.remove = None

    def snapshot(self) -> Record:
        """Publish what is pending, then the whole picture as of the records published."""
        self.flush()
        return engine_snapshot(
            self.scheduler, self.kv, self.current(), self.step, self._owner, self.tokenizer
        )

    # --------------------------------------------------------- the step loop
    def on_step_begin(self, step_number: int) -> None:
        self.flush()
        self.step = step_number

    def on_step_end(
        self, step: SchedulerOutput, outputs: Sequence[RequestOutput], ran: EngineSnapshot
    ) -> None:
        for request_id in step.preempted:
            self._note_before_frees({"k": "preempt", "req": request_id})
        self._events.extend({"k": "finish", "req": o.request_id} for o in outputs if o.finished)
        self.flush(force=True)

    def on_abort(self, request_id: str) -> None:
        self._events.append({"k": "abort", "req": request_id})

    def flush(self, force: bool = False) -> None:
        """Hand the sink the events gathered since the last record (if any, or `force`)."""
        if self._text_from:
            self._read_text()
        if not (self._events or force):
            return
        events, self._events = self._events, []
        self.sink({"step": self.step, "ev": events, "st": self.current().figures()})

    # ------------------------------------------------- the allocator's hooks
    def on_cached(self, block: int) -> None:
        self._events.append({"k": "cache", "block": block})

    def on_evicted(self, block: int) -> None:
        self._events.append({"k": "evict", "block": block})

    def on_cache_reset(self) -> None:
        self._events.append({"k": "reset"})

    # ------------------------------------------------ the adapters' hooks
    def on_adapter_loaded(self, lora_id: int, pages: tuple[int, ...]) -> None:
        self._events.append({"k": "lora_load", "lora": lora_id, "blocks": list(pages)})

    def on_adapter_evicted(self, lora_id: int, pages: tuple[int, ...]) -> None:
        self._events.append({"k": "lora_evict", "lora": lora_id, "blocks": list(pages)})

    # --------------------------------------------------- the manager's hooks
    def on_admitted(self, seq_id: int, table: TableView, num_hits: int, group: int = 0) -> None:
        req = self._request_of(seq_id)
        if num_hits:
            blocks = _json_blocks(self.kv, table.blocks[:num_hits])
            self._table_event("hit", seq_id, req, group, blocks=blocks)
        self._table_event(
            "alloc", seq_id, req, group, blocks=table.blocks[num_hits:], tokens=table.num_tokens
        )
        self._length[seq_id, group] = len(table.blocks)
        self._seen_tokens[seq_id, group] = table.num_tokens
        self._tokens[seq_id] = table.num_tokens
        self._dirty(seq_id, num_hits)

    def on_grown(
        self, seq_id: int, table: TableView, copies: list[tuple[int, int]], group: int = 0
    ) -> None:
        req = self._owner.get(seq_id)
        key = (seq_id, group)
        old_tokens = self._seen_tokens.get(key, 0)
        for src, dst in copies:
            index = table.blocks.index(dst)
            self._table_event("cow", seq_id, req, group, index=index, src=src, dst=dst)
        old_length = self._length.get(key, 0)
        if len(table.blocks) > old_length:
            new_blocks = table.blocks[old_length:]
            self._table_event(
                "alloc", seq_id, req, group, blocks=new_blocks, tokens=table.num_tokens
            )
        elif table.num_tokens != old_tokens:
            self._table_event("append", seq_id, req, group, tokens=table.num_tokens)
        else:
            return
        self._length[key] = len(table.blocks)
        self._seen_tokens[key] = table.num_tokens
        if group == 0:
            self._tokens[seq_id] = table.num_tokens
            self._dirty(seq_id, old_tokens // self.kv.block_size)

    def on_forked(self, parent_id: int, child_id: int, table: TableView, group: int = 0) -> None:
        req = self._owner.get(parent_id)
        if req is not None:
            self._owner[child_id] = req
        self._table_event("fork", child_id, req, group, parent=parent_id)
        self._length[child_id, group] = len(table.blocks)
        self._seen_tokens[child_id, group] = table.num_tokens
        self._tokens[child_id] = table.num_tokens

    def on_freed(self, seq_id: int, table: TableView, group: int = 0) -> None:
        blocks = _json_blocks(self.kv, table.blocks)
        self._table_event("free", seq_id, self._owner.get(seq_id), group, blocks=blocks)
        self._length.pop((seq_id, group), None)
        self._seen_tokens.pop((seq_id, group), None)
        if group == self.kv.num_groups - 1:  # the sequence's last table
            self._owner.pop(seq_id, None)
            self._tokens.pop(seq_id, None)
            self._text_from.pop(seq_id, None)

    def on_dropped(
        self, seq_id: int, table: TableView, dropped: list[tuple[int, int]], group: int = 0
    ) -> None:
        upto = max(i for i, _ in dropped) + 1
        blocks = [b for _, b in dropped]
        self._table_event("drop", seq_id, self._owner.get(seq_id), group, upto=upto, blocks=blocks)

    def on_trimmed(
        self, seq_id: int, table: TableView, given_back: list[int], lookahead: int, group: int = 0
    ) -> None:
        key = (seq_id, group)
        self._table_event(
            "trim",
            seq_id,
            self._owner.get(seq_id),
            group,
            tokens=table.num_tokens,
            blocks=given_back[::-1],  # in table order: they left it last first
            la=lookahead,
        )
        self._length[key] = len(table.blocks)
        self._seen_tokens[key] = table.num_tokens
        if group == 0:
            self._tokens[seq_id] = table.num_tokens

    # ---------------------------------------------------------------- helpers
    def _table_event(
        self, kind: str, seq_id: int, req: str | None, group: int, **fields: Any
    ) -> None:
        """One event of a sequence's table in `group`, with its kind's fields (kv/events.py
        `EVENT_FIELDS`): `g` only for a group other than the first, so a model of one
        kind's events carry none."""
        g = {"g": group} if group else {}
        self._events.append({"k": kind, "seq": seq_id, "req": req, **g, **fields})

    def _seen(self, kv: KVCacheManager) -> None:
        """Take the tables that exist now as the starting point."""
        self._owner = owners_of(self.scheduler)
        for seq_id, seq in kv.tables.items():
            for group, table in enumerate(seq.groups):
                self._length[seq_id, group] = len(table.blocks)
                self._seen_tokens[seq_id, group] = table.num_tokens
            self._tokens[seq_id] = seq.num_tokens

    def _request_of(self, seq_id: int) -> str | None:
        req = self._owner.get(seq_id)
        if req is None:  # a sequence admitted for the first time: look its request up
            self._owner.update(owners_of(self.scheduler))
            req = self._owner.get(seq_id)
        return req

    def _note_before_frees(self, note: Event) -> None:
        """Put a note before the first `free` of its request in this step, else last."""
        req = note["req"]
        for i, event in enumerate(self._events):
            if event["k"] == "free" and event["req"] == req:
                self._events.insert(i, note)
                return
        self._events.append(note)

    def _dirty(self, seq_id: int, first_block: int) -> None:
        if self.tokenizer is not None:
            self._text_from[seq_id] = min(self._text_from.get(seq_id, first_block), first_block)

    def _read_text(self) -> None:
        """Text mode: a `text` event for every block whose tokens changed."""
        seqs = seqs_of(self.scheduler)
        bs = self.kv.block_size
        for seq_id, first in self._text_from.items():
            seq, tokens = seqs.get(seq_id), self._tokens.get(seq_id)
            if seq is None or tokens is None:
                continue
            for table in self.kv.tables[seq_id].groups:
                blocks = table.blocks
                for i in range(first, min(len(blocks), -(-tokens // bs))):
                    if blocks[i] == self.kv.null_block:
                        continue
                    ids = seq.token_ids[i * bs : min(tokens, (i + 1) * bs)]
                    self._events.append(
                        {"k": "text", "block": blocks[i], "text": self._decode(ids)}
                    )
        self._text_from.clear()

    def _decode(self, token_ids: Iterable[int]) -> str:
        return str(self.tokenizer.decode(list(token_ids)))


def _json_blocks(kv: KVCacheManager, blocks: Sequence[int]) -> list[int]:
    """Table entries as events carry them: the null block as -1."""
    null = kv.null_block
    return [-1 if b == null else b for b in blocks]


def owners_of(scheduler: Scheduler) -> dict[int, str]:
    """Sequence id -> request id of every live request."""
    return {s.seq_id: r.request_id for r in scheduler.requests.values() for s in r.seqs}


def seqs_of(scheduler: Scheduler) -> dict[int, Seq]:
    return {s.seq_id: s for r in scheduler.requests.values() for s in r.seqs}


def engine_snapshot(
    scheduler: Scheduler,
    kv: KVCacheManager,
    figures: EngineSnapshot,
    step: int,
    owners: dict[int, str] | None = None,
    tokenizer: Any = None,
) -> Record:
    """The pool, every live table and request, and the figures, as one JSON-ready dict.
    With a tokenizer, `text` maps each used block to its tokens' text."""
    owners = owners if owners is not None else owners_of(scheduler)
    snapshot: Record = {
        "step": step,
        "pool": PoolState.of(kv, owners).to_json(),
        "requests": [_request_json(r) for r in scheduler.requests.values()],
        "st": figures.figures(),
    }
    if tokenizer is not None:
        seqs = seqs_of(scheduler)
        bs = kv.block_size
        text: dict[int, str] = {}
        for seq_id, tables in kv.tables.items():
            seq = seqs.get(seq_id)
            for table in tables.groups if seq is not None else []:
                for i, block in enumerate(table.blocks):
                    if block not in text and block != kv.null_block:
                        ids = seq.token_ids[i * bs : min(table.num_tokens, (i + 1) * bs)]
                        text[block] = str(tokenizer.decode(list(ids)))
        snapshot["text"] = {str(b): t for b, t in text.items()}
    return snapshot


def _request_json(req: Request) -> dict[str, Any]:
    return {
        "id": req.request_id,
        "status": req.status.value,
        "seqs": [s.seq_id for s in req.seqs],
        "prompt_tokens": len(req.prompt_token_ids),
        "tokens": req.num_tokens,
        "width": req.num_seq_slots,
        "beam": isinstance(req.params, BeamSearchParams),
        "preemptions": req.num_preemptions,
        "lora": req.lora_id,
    }
