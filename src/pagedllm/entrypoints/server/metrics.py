"""Prometheus metrics of the server, in a registry of its own (one per app).

Engine figures (KV blocks, queue lengths, preemptions, prefix-cache hits) are read from
the async engine's latest snapshot at scrape time; per-request figures (tokens, time to
first token, inter-token latency, end-to-end latency) are recorded as outputs stream out.
A whole (not streamed) response gets one output from the engine, at its end: its time to
first token is dated back by the engine's own times, and it has no inter-token latency.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagedllm.engine.engine_client import EngineClient
from pagedllm.engine.outputs import RequestOutput

P = "pagedllm:"
TTFT_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
ITL_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
)
E2E_BUCKETS = (
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
)


class EngineCollector(Collector):
    """Gauges and cumulative counters read from the engine's snapshot at scrape time."""

    def __init__(self, engine: EngineClient) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        snap = self.engine.snapshot
        u = snap.usage
        gauges = {
            "kv_blocks_total": ("KV cache blocks in the pool", u.num_blocks),
            "kv_blocks_used": ("KV cache blocks held by sequences", u.used_blocks),
            "kv_blocks_free": ("KV cache blocks free (including cached ones)", u.free_blocks),
            "kv_blocks_cached": ("blocks holding a cached prefix, in use or free", u.cached_blocks),
            "kv_cache_usage_perc": (
                "fraction of KV blocks in use (0..1)",
                u.used_blocks / u.num_blocks if u.num_blocks else 0.0,
            ),
            "kv_utilization": (
                "tokens stored / slots reserved in used blocks (0..1)",
                u.utilization,
            ),
            "kv_tokens_stored": ("tokens whose K/V is stored", u.tokens_stored),
            "kv_shared_blocks": ("blocks shared by more than one sequence", u.shared_blocks),
            "kv_blocks_saved_by_sharing": (
                "block-table entries minus blocks in use: what sharing saves",
                u.blocks_saved_by_sharing,
            ),
            "num_requests_running": ("requests running", snap.num_running),
            "num_requests_waiting": ("requests waiting to be scheduled", snap.num_waiting),
            "num_requests_backlog": (
                "waiting requests the engine cannot admit now (what --max-waiting bounds)",
                snap.backlog,
            ),
            "num_seqs_running": ("sequences running", snap.num_running_seqs),
            "prefix_cache_hit_rate": (
                "prompt tokens served by the prefix cache / prompt tokens",
                snap.prefix_hit_rate,
            ),
            "spec_decode_acceptance_rate": (
                "speculative decoding: proposed tokens accepted / proposed (0..1)",
                snap.spec_acceptance_rate,
            ),
            "spec_decode_mean_accepted_length": (
                "speculative decoding: tokens a sequence gains per checking step, the "
                "model's own included",
                snap.spec_mean_accepted_length,
            ),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(P + name, doc, value=value)
        counters = {
            "num_preemptions": ("requests preempted (recomputed later)", snap.num_preemptions),
            "prefix_cache_queries": (
                "prompt tokens looked up in the prefix cache",
                snap.prefix_query_tokens,
            ),
            "prefix_cache_hits": (
                "prompt tokens found in the prefix cache",
                snap.prefix_hit_tokens,
            ),
            "engine_steps": ("engine steps run", snap.num_steps),
            "spec_decode_num_drafts": (
                "speculative decoding: sequence-steps that checked proposed tokens",
                snap.spec_checks,
            ),
            "spec_decode_num_draft_tokens": ("tokens proposed", snap.spec_proposed_tokens),
            "spec_decode_num_accepted_tokens": (
                "proposed tokens the model accepted",
                snap.spec_accepted_tokens,
            ),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(P + name, doc, value=value)


class ServerMetrics:
    def __init__(self, engine: EngineClient) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine))
        r = self.registry
        self.prompt_tokens = Counter(P + "prompt_tokens", "prompt tokens processed", registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "tokens generated", registry=r)
        self.requests = Counter(
            P + "request_finished", "requests finished, by reason", ["finished_reason"], registry=r
        )
        self.rejected = Counter(
            P + "request_rejected", "requests refused, by HTTP status", ["status"], registry=r
        )
        self.ttft = Histogram(
            P + "time_to_first_token_seconds",
            "time to first token",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            P + "inter_token_latency_seconds",
            "time between output steps",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            P + "e2e_request_latency_seconds",
            "arrival to last token",
            buckets=E2E_BUCKETS,
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def tracker(self, arrival: float) -> RequestTracker:
        return RequestTracker(self, arrival)


class RequestTracker:
    """Records one request's figures as its outputs arrive."""

    def __init__(self, metrics: ServerMetrics, arrival: float) -> None:
        self.m = metrics
        self.arrival = arrival
        self.last: float | None = None
        self.tokens = 0  # generated so far
        self.prompt_tokens = 0
        self.cached_tokens = 0  # of the prompt, served by the prefix cache at admission
        self.reasons: set[str] = set()  # how its samples ended
        self.done = False

    def on_output(self, out: RequestOutput) -> None:
        """Record an output: a stream's delta, or a whole response's one final output
        (dated back to its first token by the engine's own times)."""
        now = time.monotonic()
        if out.prompt_token_ids is not None:  # the request's first output
            self.prompt_tokens = len(out.prompt_token_ids)
            self.cached_tokens = out.num_cached_tokens
        tokens = sum(len(c.token_ids) for c in out.outputs)
        if tokens:
            self.m.generation_tokens.inc(tokens)
            self.tokens += tokens
            if self.last is None:
                times = out.metrics
                if out.finished and times is not None and times.first_token_time is not None:
                    first = now - ((times.finished_time or 0.0) - times.first_token_time)
                else:
                    first = now
                self.m.ttft.observe(max(first - self.arrival, 0.0))
                self.m.prompt_tokens.inc(self.prompt_tokens)
            else:
                self.m.itl.observe(now - self.last)
            self.last = now
        self.reasons.update(c.finish_reason for c in out.outputs if c.finish_reason)
        if out.finished:
            self.finish("length" if self.reasons == {"length"} else "stop")

    def finish(self, reason: str) -> None:
        """Count the request once: "stop", "length", "abort" or "error"."""
        if self.done:
            return
        self.done = True
        self.m.requests.labels(finished_reason=reason).inc()
        if reason in ("stop", "length"):
            self.m.e2e.observe(time.monotonic() - self.arrival)
