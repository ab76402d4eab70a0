"""PrefixAwareRouter: a Ray Serve request router that sends a prompt to the engine
replica whose prefix cache holds the longest part of it.

The ingress passes the prompt's token ids (chat template applied) in the handle call; the
router hashes its full blocks exactly as the engine does (kv/allocator.py `hash_block`,
chained, all but the block holding the last token: `find_cached_prefix`'s rule) and counts,
per replica, how many leading blocks it holds. What a replica holds comes from two
sources: its routing stats (`record_routing_stats`: the hashes of its prefix cache, pulled
by Ray Serve every `request_routing_stats_period_s`), and the router's own recent choices
(a prompt routed to a replica will be cached there; remembered for `recent_ttl_s`), which
cover the stats' delay: the next turn of a conversation follows the first even if it
comes before the next stats pull.

Balance: the replica with the longest match wins unless its load (ongoing requests, as
the router counts them) exceeds the least-loaded replica's by more than `max_imbalance`,
or the match is under `min_match_blocks`: then the least-loaded replica wins. Other
replicas follow as fallbacks, least loaded first.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from pagedllm.kv.allocator import hash_block

MAX_RECENT = 200_000  # remembered (hash -> replica) choices


def prompt_block_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """The chained hashes of the prompt's full blocks the engine could serve from cache."""
    hashes: list[bytes] = []
    parent = b""
    for i in range((len(token_ids) - 1) // block_size):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
    return hashes


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
        # Each replica's stats as a set, rebuilt only when Ray hands over new stats.
        self._held: dict[ReplicaID, tuple[int, frozenset[bytes]]] = {}
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
        hashes = prompt_block_hashes(tokens, self.block_size)
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

    # ---------------------------------------------------------------- helpers
    def _load(self, replica: RunningReplica) -> int:
        queued = self.replica_queue_len_cache.get(replica.replica_id)
        if queued is not None:
            return queued
        stats = replica.routing_stats or {}
        return int(stats.get("running", 0)) + int(stats.get("waiting", 0))

    def _holds(self, replica: RunningReplica) -> frozenset[bytes]:
        stats = replica.routing_stats or {}
        known = self._held.get(replica.replica_id)
        if known is None or known[0] != id(stats):
            known = (id(stats), frozenset(stats.get("cached", ())))
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
        for h in hashes:
            self._recent[h] = (replica_id, now)
            self._recent.move_to_end(h)
        while len(self._recent) > MAX_RECENT:
            self._recent.popitem(last=False)
