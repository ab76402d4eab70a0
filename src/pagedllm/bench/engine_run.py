"""Drive the real LLMEngine over a workload: offline (all requests at once) or with
arrivals on a clock of real wall time; sample the KV pool every step.

Each run builds a fresh engine for one reservation policy from the shared LoadedModel,
warms it up on a 4-token request, then times only the workload. Greedy sampling,
`ignore_eos=True, max_tokens=output_len`: every policy computes the same tokens.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Sequence
from typing import Any

from pagedllm.bench.accounting import KVTimeline, slot_breakdown
from pagedllm.bench.common import BenchSettings
from pagedllm.bench.workload import BenchRequest
from pagedllm.engine.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.loader import LoadedModel
from pagedllm.sampling_params import SamplingParams


class AttentionTimer:
    """Wraps each decoder layer's attention callable and adds up its wall time."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0

    def wrap(self, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1

        return timed

    def install(self, engine: LLMEngine) -> bool:
        """False when the model exposes no per-layer `attention` to wrap."""
        layers = getattr(engine.runner.model, "layers", None)
        if not layers or not all(hasattr(layer, "attention") for layer in layers):
            return False
        for layer in layers:
            layer.attention = self.wrap(layer.attention)
        return True


def build_engine(loaded: LoadedModel, settings: BenchSettings, policy: str) -> LLMEngine:
    gc.collect()
    engine = LLMEngine(EngineConfig(**settings.engine_options(policy)), loaded)
    warm = SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0)
    engine.add_request("warmup", [1, 2, 3, 4], warm)
    while engine.has_unfinished_requests():
        engine.step()
    return engine


def _params(r: BenchRequest) -> SamplingParams:
    return SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0.0)


def run_engine(
    loaded: LoadedModel,
    requests: Sequence[BenchRequest],
    settings: BenchSettings,
    policy: str,
    *,
    use_arrivals: bool = False,
    time_attention: bool = False,
) -> dict[str, Any]:
    """Run the workload to completion; throughput, KV figures and per-request latencies."""
    engine = build_engine(loaded, settings, policy)
    timer = AttentionTimer()
    timed = time_attention and timer.install(engine)
    preempt0 = engine.scheduler.num_preemptions
    final_len = {str(i): r.total_len for i, r in enumerate(requests)}
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_time)
    if not use_arrivals:
        for i in order:
            engine.add_request(str(i), list(requests[i].prompt_token_ids), _params(requests[i]))
        order = []
    timeline = KVTimeline()
    first: dict[str, float] = {}
    finish: dict[str, float] = {}
    generated = 0
    skipped = 0.0  # idle time skipped forward to the next arrival
    start = time.perf_counter()

    def now() -> float:
        return time.perf_counter() - start + skipped

    step_seconds = 0.0
    while order or engine.has_unfinished_requests():
        t = now()
        while order and requests[order[0]].arrival_time <= t:
            i = order.pop(0)
            engine.add_request(str(i), list(requests[i].prompt_token_ids), _params(requests[i]))
        if not engine.has_unfinished_requests():
            skipped += requests[order[0]].arrival_time - t
            continue
        t0 = time.perf_counter()
        outputs = engine.step()
        step_seconds += time.perf_counter() - t0
        t = now()
        done = 0
        for out in outputs:
            first.setdefault(out.request_id, t)
            if out.finished:
                finish[out.request_id] = t
                generated += sum(len(c.token_ids) for c in out.outputs)
                done += 1
        usage = engine.stats.last_usage or engine.kv.usage()
        running = engine.scheduler.num_running_seqs + done
        timeline.sample(t, usage, running, slot_breakdown(engine.scheduler, engine.kv, final_len))
    elapsed = now()  # with arrivals: includes idle time skipped forward
    wall = time.perf_counter() - start
    n = len(requests)
    result: dict[str, Any] = {
        "system": policy,
        "requests": n,
        "generated_tokens": generated,
        "seconds": round(wall, 3),
        "requests_per_s": round(n / elapsed, 3) if elapsed else None,
        "generated_tokens_per_s": round(generated / elapsed, 2) if elapsed else None,
        "preemptions": engine.scheduler.num_preemptions - preempt0,
        "kv_blocks": settings.num_kv_blocks,
        **timeline.summary(),
    }
    steps = max(timeline.steps, 1)
    result["step_ms"] = round(1000 * step_seconds / steps, 2)
    if timed:
        result["attention_ms_per_step"] = round(1000 * timer.seconds / steps, 3)
    result["timeline"] = timeline.series()
    result["latency"] = {
        rid: {
            "arrival": requests[int(rid)].arrival_time,
            "first_token": first.get(rid),
            "finish": finish.get(rid),
            "output_len": requests[int(rid)].output_len,
        }
        for rid in final_len
    }
    del engine
    gc.collect()
    return result
