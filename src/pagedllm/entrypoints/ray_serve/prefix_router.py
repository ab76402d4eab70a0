"""PrefixAwareRouter: a Ray Serve request router that sends a prompt to the engine
replica whose prefix cache holds the longest part of it.

The ingress passes the prompt's token ids (chat template applied) in the handle call; the
router hashes its blocks with the engine's own rule (kv/block_hash.py
`prompt_block_hashes`: the blocks a cache hit could cover) and counts, per replica, how
many leading blocks it holds. What a replica holds comes from two
sources: its routing stats (`record_routing_stats`: the hashes of its prefix cache, pulled
by Ray Serve every `request_routing_stats_period_s`), and the router's own recent choices
(a prompt routed to a replica will be cached there; remembered for `recent_ttl_s`), which
cover the stats' delay: the next turn of a conversation follows the first even if it
comes before the next stats pull.

Balance: the replica with the longest match wins unless its load (ongoing requests, as
the router counts them) exceeds the least-loaded replica's by more than `max_imbalance`,
or the match is under `min_match_blocks`: then the least-loaded replica wins. Other
replicas follow as fallbacks, least loaded first.

Faults: a replica whose stats are missing, stale or malformed counts as holding nothing
(and its load comes from Ray's queue-length cache, else 0): routing goes on by load. When
a replica dies (`on_replica_actor_died`) or leaves the replica set (`update_replicas`),
everything the router knew of it is dropped; its replacement is a new replica whose
holdings come from its own stats.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from pagedllm.kv.block_hash import prompt_block_hashes

MAX_RECENT = 200_000  # remembered (hash -> replica) choices


def prompt_of(pending: PendingRequest | None) -> Sequence[int] | None:
    """The token ids of the first prompt of a `generate(requests, ...)` call."""
    if pending is None or not pending.args:
        return None
    requests = pending.args[0]
    try:
        prompt = requests[0][1]
    except (TypeError, IndexError, KeyError):
        return None
    return prompt if isinstance(prompt, list) else None


def adapter_of(pending: PendingRequest) -> int:
    """The LoRA adapter id a `generate(requests, arrival_time, grammar_param,
    lora_request)` call runs under (0: the base): prefixes are cached per adapter."""
    args = pending.args
    lora = args[3] if len(args) > 3 else pending.kwargs.get("lora_request")
    return getattr(lora, "lora_int_id", 0)


class PrefixAwareRouter(RequestRouter):
    def initialize_state(
        self,
        block_size: int = 16,
        max_imbalance: int = 4,
        min_match_blocks: int = 1,
        recent_ttl_s: float = 30.0,
        **_: Any,
    ) -> None:
        self.block_size = block_size
        self.max_imbalance = max_imbalance
        self.min_match_blocks = min_match_blocks
        self.recent_ttl_s = recent_ttl_s
        self._recent: OrderedDict[bytes, tuple[ReplicaID, float]] = OrderedDict()
        # Each replica's stats as a set, rebuilt only when Ray hands over a new stats dict
        # (the dict is kept so that its identity is not reused by another).
        self._held: dict[ReplicaID, tuple[object, frozenset[bytes]]] = {}
        self._live: frozenset[ReplicaID] = frozenset()
        self.num_prefix_routed = 0
        self.num_balanced = 0

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_load = sorted(candidate_replicas, key=self._load)
        tokens = prompt_of(pending_request)
        if tokens is None:
            return [by_load]
        hashes = prompt_block_hashes(tokens, self.block_size, adapter_of(pending_request))
        now = time.monotonic()
        best, best_match = by_load[0], 0
        for replica in by_load:  # ties go to the less loaded
            match = self._match(replica, hashes, now)
            if match > best_match:
                best, best_match = replica, match
        least = by_load[0]
        if (
            best_match < self.min_match_blocks
            or self._load(best) - self._load(least) > self.max_imbalance
        ):
            best = least
            self.num_balanced += 1
        else:
            self.num_prefix_routed += 1
        self._remember(hashes, best.replica_id, now)
        return [[best], [r for r in by_load if r is not best]]

    # ------------------------------------------------------- replica set changes
    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget({replica_id})

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = frozenset(r.replica_id for r in replicas)
        if live != self._live:  # called on every stats update too: act on changes only
            self._forget(self._live - live)
            self._live = live

    def _forget(self, gone: set[ReplicaID] | frozenset[ReplicaID]) -> None:
        if not gone:
            return
        for replica_id in gone:
            self._held.pop(replica_id, None)
        for h in [h for h, (replica_id, _) in self._recent.items() if replica_id in gone]:
            del self._recent[h]

    # ---------------------------------------------------------------- helpers
    def _load(self, replica: RunningReplica) -> int:
        queued = self.replica_queue_len_cache.get(replica.replica_id)
        if queued is not None:
            return queued
        try:
            stats = replica.routing_stats or {}
            return int(stats.get("running", 0)) + int(stats.get("waiting", 0))
        except Exception:  # stats missing or malformed: no load known
            return 0

    def _holds(self, replica: RunningReplica) -> frozenset[bytes]:
        try:
            stats = replica.routing_stats or {}
        except Exception:  # stats that cannot be read: nothing known to be held
            return frozenset()
        known = self._held.get(replica.replica_id)
        if known is None or known[0] is not stats:
            try:
                held = frozenset(h for h in stats.get("cached", ()) if isinstance(h, bytes))
            except Exception:
                held = frozenset()
            known = (stats, held)
            self._held[replica.replica_id] = known
        return known[1]

    def _match(self, replica: RunningReplica, hashes: list[bytes], now: float) -> int:
        """Leading blocks of the prompt the replica holds (or was recently sent)."""
        held = self._holds(replica)
        n = 0
        for h in hashes:
            if h not in held:
                recent = self._recent.get(h)
                if recent is None or recent[0] != replica.replica_id:
                    break
                if now - recent[1] > self.recent_ttl_s:
                    break
            n += 1
        return n

    def _remember(self, hashes: list[bytes], replica_id: ReplicaID, now: float) -> None:
        if not self.recent_ttl_s:  # 0: no memory of recent choices, the stats alone
            return
        for h in hashes:
            self._recent[h] = (replica_id, now)
            self._recent.move_to_end(h)
        while len(self._recent) > MAX_RECENT:
            self._recent.popitem(last=False)
