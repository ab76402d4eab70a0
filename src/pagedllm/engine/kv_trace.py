"""KV traces: a run's KV events in one JSON file, for `pagedllm kv-view` to replay.

`KVTrace.record(engine)` starts a KV recorder that keeps every step's record; `close()`
stops it and returns the trace, `write(path)` saves it. A trace holds the pool it
started from (a snapshot) and the records in step order, so replaying them from the start
gives the pool at any step. `load_trace` reads one back and checks its shape.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from pagedllm.engine.kv_recorder import KVRecorder, Record
from pagedllm.engine.llm_engine import LLMEngine

FORMAT = "pagedllm-kv-trace"
VERSION = 1


class KVTrace:
    def __init__(self, recorder: KVRecorder, records: list[Record], meta: dict[str, Any]) -> None:
        self._recorder: KVRecorder | None = recorder
        self.records = records
        self.start = recorder.snapshot()
        self.meta = meta

    @classmethod
    def record(cls, engine: LLMEngine, *, text: bool = False, **meta: Any) -> KVTrace:
        """Record `engine` from now on; `text` also keeps each block's token text; `meta`
        (the model, the command) is stored as it is."""
        records: list[Record] = []
        recorder = engine.record_kv(records.append, text=text)
        return cls(recorder, records, {"created": time.time(), "text": text, **meta})

    def close(self) -> dict[str, Any]:
        """Stop recording; the trace as a JSON-ready dict."""
        if self._recorder is not None:
            self._recorder.close()
            self._recorder = None
        return {
            "format": FORMAT,
            "version": VERSION,
            "meta": self.meta,
            "start": self.start,
            "records": self.records,
        }

    def write(self, path: str | Path) -> dict[str, Any]:
        trace = self.close()
        # Compact separators: a long run has hundreds of thousands of small events.
        Path(path).write_text(json.dumps(trace, separators=(",", ":")), encoding="utf-8")
        return trace


def load_trace(path: str | Path) -> dict[str, Any]:
    """A trace written by KVTrace; ValueError naming the problem if it is not one."""
    try:
        trace = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"cannot read the trace {path}: {exc.strerror}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not JSON: {exc}") from None
    if not isinstance(trace, dict) or trace.get("format") != FORMAT:
        raise ValueError(f"{path} is not a pagedllm KV trace (write one with --kv-trace)")
    if trace.get("version") != VERSION:
        raise ValueError(f"{path} is a version {trace.get('version')} trace; this reads {VERSION}")
    if not isinstance(trace.get("records"), list) or "pool" not in trace.get("start", {}):
        raise ValueError(f"{path} is a damaged KV trace: no start snapshot or records")
    return trace
