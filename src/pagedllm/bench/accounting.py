"""KV accounting over a run: a per-step timeline of the pool, and where reserved slots go.

Each reserved slot of a running sequence is one of three things (the vLLM paper's Fig. 2):
* a **token**: it holds a computed token's K/V;
* **reserved**: empty now, but this request's later tokens will fill it;
* **wasted**: empty and never filled (the tail of the last block under `paged`; the
  over-reservation under `reserve-max` / `reserve-pow2`).
Our reservation baselines take blocks from one pool, so they suffer no external
fragmentation: their waste here is a lower bound of a contiguous allocator's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedllm.core.scheduler import Scheduler
from pagedllm.kv.manager import KVCacheManager, KVUsage


def slot_breakdown(
    scheduler: Scheduler, kv: KVCacheManager, final_len: dict[str, int]
) -> dict[str, int]:
    """Slots of the running sequences by kind, and the most empty slots any one holds."""
    tokens = reserved = wasted = max_empty = 0
    for req in scheduler.running:
        final = final_len.get(req.request_id, 0)
        for seq in req.seqs:
            table = kv.tables.get(seq.seq_id)
            if table is None:
                continue
            cap, stored = table.capacity, table.num_tokens
            will_fill = max(stored, min(cap, final))
            tokens += stored
            reserved += will_fill - stored
            wasted += cap - will_fill
            max_empty = max(max_empty, cap - stored)
    return {
        "tokens": tokens,
        "reserved": reserved,
        "wasted": wasted,
        "max_empty_per_seq": max_empty,
    }


@dataclass
class KVTimeline:
    """One sample per engine step; summaries are means over steps, as EngineStats keeps."""

    t: list[float] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    used_blocks: list[int] = field(default_factory=list)
    utilization: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    reserved: list[int] = field(default_factory=list)
    wasted: list[int] = field(default_factory=list)
    max_empty_per_seq: int = 0

    def sample(
        self, t: float, usage: KVUsage, running: int, breakdown: dict[str, int] | None = None
    ) -> None:
        self.t.append(t)
        self.running.append(running)
        self.used_blocks.append(usage.used_blocks)
        self.utilization.append(usage.utilization)
        b = breakdown or {
            "tokens": usage.tokens_stored,
            "reserved": 0,
            "wasted": usage.empty_slots,
            "max_empty_per_seq": 0,
        }
        self.tokens.append(b["tokens"])
        self.reserved.append(b["reserved"])
        self.wasted.append(b["wasted"])
        self.max_empty_per_seq = max(self.max_empty_per_seq, b["max_empty_per_seq"])

    @property
    def steps(self) -> int:
        return len(self.t)

    def summary(self) -> dict[str, Any]:
        n = max(self.steps, 1)
        slots = sum(self.tokens) + sum(self.reserved) + sum(self.wasted)
        return {
            "steps": self.steps,
            "mean_running_seqs": round(sum(self.running) / n, 2),
            "peak_running_seqs": max(self.running, default=0),
            "peak_used_blocks": max(self.used_blocks, default=0),
            "kv_utilization": round(sum(self.utilization) / n, 4) if self.steps else None,
            "slots_tokens_frac": round(sum(self.tokens) / slots, 4) if slots else None,
            "slots_reserved_frac": round(sum(self.reserved) / slots, 4) if slots else None,
            "slots_wasted_frac": round(sum(self.wasted) / slots, 4) if slots else None,
            "max_empty_slots_per_seq": self.max_empty_per_seq,
        }

    def series(self, max_points: int = 400) -> dict[str, list[Any]]:
        """The timeline thinned to at most max_points samples, for JSON and plots."""
        every = max(1, -(-self.steps // max_points))
        return {
            "t": [round(x, 4) for x in self.t[::every]],
            "running": self.running[::every],
            "utilization": [round(x, 4) for x in self.utilization[::every]],
            "used_blocks": self.used_blocks[::every],
        }
