"""What the tests read (and, for the engine loop, set) inside the package's objects.

The package exposes none of this: each function here reads the object's own private
state, so src carries no member only a test calls. Each one does what the member it
replaced did, under the same lock where the object takes one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the router's module imports Ray, the grammar's xgrammar and torch
    from ray.serve.request_router import ReplicaID

    from pagedllm.engine.async_engine import AsyncLLMEngine
    from pagedllm.engine.kv_event_publisher import KVEventPublisher
    from pagedllm.entrypoints.ray_serve.prefix_router import PrefixAwareRouter
    from pagedllm.entrypoints.server.kv_feed import KVFeed
    from pagedllm.kv.allocator import BlockAllocator
    from pagedllm.kv.block_table import BlockTable
    from pagedllm.kv.manager import KVCacheManager
    from pagedllm.structured.compile_pool import CompilePool
    from pagedllm.structured.grammar import GrammarCompiler
    from pagedllm.worker.batch_tables import BatchTables


# ------------------------------------------------------------------ KV bookkeeping
def free_block_ids(allocator: BlockAllocator) -> list[int]:
    """Free blocks in the order they will be allocated."""
    return list(allocator._free)


def block_table(kv: KVCacheManager, seq_id: int, group: int = 0) -> BlockTable:
    """The sequence's block table of layer group `group`."""
    return kv.tables[seq_id].groups[group]


def runner_tables(tables: BatchTables, seq_id: int) -> tuple[tuple[int, ...], ...]:
    """The runner's copy of the sequence's tables, one per layer group (to check it
    against the scheduler's)."""
    row = tables.row_of[seq_id]
    return tuple(
        tuple(tables.store.read(g, row, tables.lengths[g][row])) for g in range(tables.num_groups)
    )


# ---------------------------------------------------------------- the engine loop
def loop_running(engine: AsyncLLMEngine) -> bool:
    """Whether the engine's loop thread is alive."""
    return engine._thread is not None and engine._thread.is_alive()


def pause(engine: AsyncLLMEngine) -> None:
    """Stop stepping: requests are still added and aborted, but make no progress."""
    with engine._cond:
        engine._paused = True


def resume(engine: AsyncLLMEngine) -> None:
    with engine._cond:
        engine._paused = False
        engine._cond.notify_all()


# ---------------------------------------------------------------------- KV events
def wait_for_subscribers(publisher: KVEventPublisher, n: int = 1, timeout: float = 10.0) -> bool:
    """Block until `n` subscriptions are known (True), or `timeout` seconds pass."""
    with publisher._subscribed:
        return publisher._subscribed.wait_for(lambda: publisher._subscribers >= n, timeout)


def recorder_attached(feed: KVFeed) -> bool:
    """Whether the KV view's feed has its recorder attached to the engine."""
    return feed._recorder is not None


def retained_records(feed: KVFeed) -> int:
    """The records the feed's ring holds."""
    return feed._head - feed._tail


# ------------------------------------------------------------- structured output
def num_compiles(compiler: GrammarCompiler) -> int:
    """Compiles run (cache misses), by every thread."""
    return sum(compiler.compiles_by_thread.values())


def grammar_cache_bytes(compiler: GrammarCompiler) -> int:
    """What the kept compiled grammars take, in bytes."""
    return compiler._cache.nbytes


def idle_worker_pids(pool: CompilePool) -> list[int]:
    """The idle compile workers' process ids."""
    with pool._cond:
        return [w.process.pid for w in pool._idle if w.process.pid is not None]


# ---------------------------------------------------------------------- Ray Serve
def known_replicas(router: PrefixAwareRouter) -> set[ReplicaID]:
    """The replicas the router holds state for (stats sets or recent choices)."""
    return set(router._held) | {replica_id for replica_id, _ in router._recent.values()}
