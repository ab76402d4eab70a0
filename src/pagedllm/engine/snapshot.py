"""EngineSnapshot: the engine's figures at one moment, immutable, safe to pass anywhere.

The one read side of the engine: the server's metrics and backlog, the KV view's charts,
`EngineStats`, the CLI's summary and the benches all read these figures and nothing
else of the engine's insides. `LLMEngine.snapshot()` takes one (O(1) in the pool's
size); step listeners get one per step (engine/listeners.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedllm.kv.manager import KVUsage


@dataclass(frozen=True)
class TableFigures:
    """One live sequence's block table: slots it holds (`capacity`) and fills."""

    request_id: str
    seq_id: int
    capacity: int
    num_tokens: int


@dataclass(frozen=True)
class EngineSnapshot:
    num_steps: int  # steps the engine has run
    usage: KVUsage  # the block pool
    num_running: int  # requests
    num_waiting: int
    num_running_seqs: int
    num_preemptions: int  # since the engine started
    prefix_query_tokens: int  # prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int  # of them, found there
    # Waiting requests the scheduler could admit now (free sequence slots and KV blocks,
    # reservations counted): the rest are the backlog.
    num_admissible: int
    # The running sequences' tables, only when asked for (`snapshot(tables=True)`).
    tables: tuple[TableFigures, ...] = ()

    @property
    def backlog(self) -> int:
        """Waiting requests the engine could not admit now: what `max_waiting` bounds."""
        return self.num_waiting - self.num_admissible

    @property
    def prefix_hit_rate(self) -> float:
        queried = self.prefix_query_tokens
        return self.prefix_hit_tokens / queried if queried else 0.0

    def figures(self) -> dict[str, Any]:
        """The compact figures the KV view charts (a record's `st`)."""
        u = self.usage
        return {
            "used": u.used_blocks,
            "cached": u.cached_blocks,
            "tokens": u.tokens_stored,
            "util": round(u.utilization, 4),
            "shared": u.shared_blocks,
            "run": self.num_running,
            "wait": self.num_waiting,
            "seqs": self.num_running_seqs,
            "pre": self.num_preemptions,
        }
