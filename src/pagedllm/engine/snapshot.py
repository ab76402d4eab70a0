"""EngineSnapshot: the engine's figures at one moment, immutable, safe to pass anywhere.

The one read side of the engine: the server's metrics and backlog, the KV view's charts,
`EngineStats`, the CLI's summary and the benches all read these figures and nothing
else of the engine's insides. `LLMEngine.snapshot()` takes one (O(1) in the pool's
size); step listeners get one per step (engine/listeners.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedllm.core.scheduler import Scheduler
from pagedllm.kv.manager import KVCacheManager, KVUsage


@dataclass(frozen=True)
class TableFigures:
    """One live sequence's block tables: slots they span (`capacity`) and fill, and the
    pool blocks each layer group's table holds (one group in a model of one kind)."""

    request_id: str
    seq_id: int
    capacity: int
    num_tokens: int
    group_blocks: tuple[int, ...] = ()


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
    # The hashes of the prefix cache's blocks of the first layer group (what KV events
    # describe), only when asked for (`snapshot(cached_hashes=True)`: O(blocks)).
    cached_hashes: frozenset[bytes] | None = None
    # The KV layer groups' windows (None: full attention); one entry per group.
    group_windows: tuple[int | None, ...] = (None,)
    # Table entries given back behind a window since the engine started.
    num_dropped_blocks: int = 0
    # Speculative decoding since the engine started: sequence-steps that checked
    # proposed tokens, the tokens proposed, and those the model accepted.
    spec_checks: int = 0
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    # LoRA adapters since the engine started: loads into pool pages (first uses and
    # reloads after an eviction) and evictions to make room.
    lora_loads: int = 0
    lora_evictions: int = 0

    @property
    def backlog(self) -> int:
        """Waiting requests the engine could not admit now: what `max_waiting` bounds."""
        return self.num_waiting - self.num_admissible

    @property
    def prefix_hit_rate(self) -> float:
        queried = self.prefix_query_tokens
        return self.prefix_hit_tokens / queried if queried else 0.0

    @property
    def spec_acceptance_rate(self) -> float:
        """Proposed tokens the model accepted / proposed tokens (0 with none proposed)."""
        proposed = self.spec_proposed_tokens
        return self.spec_accepted_tokens / proposed if proposed else 0.0

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens a speculating sequence gained per step that checked its proposals: the
        accepted ones plus the model's own (vLLM's mean acceptance length; 0 with none)."""
        checks = self.spec_checks
        return 1 + self.spec_accepted_tokens / checks if checks else 0.0

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


def take_snapshot(
    scheduler: Scheduler,
    kv: KVCacheManager,
    num_steps: int,
    tables: bool = False,
    cached_hashes: bool = False,
    speculation: tuple[int, int, int] = (0, 0, 0),
) -> EngineSnapshot:
    """The figures of an engine's scheduler and pool now; `tables`: with every running
    sequence's block table; `cached_hashes`: with the prefix cache's block hashes;
    `speculation`: (checks, proposed tokens, accepted tokens) so far."""
    hashes = None
    if cached_hashes:
        alloc = kv.allocator
        hashes = frozenset(
            info.block_hash
            for block in range(alloc.num_blocks)
            if (info := alloc.cached_info(block)) is not None and info.group == 0
        )
    figures: tuple[TableFigures, ...] = ()
    if tables:
        figures = tuple(
            TableFigures(
                req.request_id, seq.seq_id, table.capacity, table.num_tokens, table.group_blocks()
            )
            for req in scheduler.running
            for seq in req.seqs
            if (table := kv.tables.get(seq.seq_id)) is not None
        )
    return EngineSnapshot(
        num_steps=num_steps,
        usage=kv.usage(),
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        num_running_seqs=scheduler.num_running_seqs,
        num_preemptions=scheduler.num_preemptions,
        prefix_query_tokens=scheduler.prefix_query_tokens,
        prefix_hit_tokens=scheduler.prefix_hit_tokens,
        num_admissible=scheduler.num_admissible(),
        tables=figures,
        cached_hashes=hashes,
        group_windows=kv.windows,
        num_dropped_blocks=kv.num_dropped_blocks,
        spec_checks=speculation[0],
        spec_proposed_tokens=speculation[1],
        spec_accepted_tokens=speculation[2],
        lora_loads=kv.adapters.num_loads if kv.adapters is not None else 0,
        lora_evictions=kv.adapters.num_evictions if kv.adapters is not None else 0,
    )
