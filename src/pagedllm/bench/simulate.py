"""The engine's bookkeeping without a model: the real Scheduler and KVCacheManager,
driven by a fake model runner that "generates" token 0 for every sequence needing one.

It reproduces what LLMEngine.step does around the model (schedule, mark computed,
sample the pool, append a token, finish at `output_len`), so block counts, admissions
and preemptions are exactly the engine's; only time is counted in steps, not seconds.
Thousands of requests take a second or two, so `memory` can use large workloads.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

from pagedllm.bench.accounting import KVTimeline, slot_breakdown
from pagedllm.bench.common import BenchSettings
from pagedllm.bench.workload import BenchRequest
from pagedllm.core.reservation import reserve_tokens
from pagedllm.core.scheduler import Scheduler, SchedulerConfig
from pagedllm.core.sequence import Request, Sequence
from pagedllm.kv.manager import KVCacheManager

WATERMARK = 0.01  # EngineConfig's default


def build(settings: BenchSettings) -> tuple[Scheduler, KVCacheManager]:
    blocks = settings.num_kv_blocks
    kv = KVCacheManager(
        blocks,
        settings.block_size,
        enable_prefix_caching=False,
        watermark_blocks=min(int(WATERMARK * blocks), blocks - 1),
    )
    sched = Scheduler(
        SchedulerConfig(
            settings.max_model_len, settings.max_num_seqs, settings.max_num_batched_tokens
        ),
        kv,
    )
    return sched, kv


def make_request(
    sched: Scheduler, rid: str, r: BenchRequest, policy: str, max_model_len: int
) -> Request:
    sched.check_fits(r.prompt_len, r.output_len)
    seq = Sequence(
        seq_id=sched.new_seq_id(),
        token_ids=list(r.prompt_token_ids),
        num_prompt_tokens=r.prompt_len,
    )
    return Request(
        request_id=rid,
        seqs=[seq],
        reserve_tokens=reserve_tokens(policy, r.prompt_len, r.output_len, max_model_len),
    )


def simulate(
    requests: Seq[BenchRequest], settings: BenchSettings, policy: str, max_steps: int = 200_000
) -> dict[str, Any]:
    """Run every request to completion (all admitted at step 0); the KV figures per step."""
    sched, kv = build(settings)
    output_len = {str(i): r.output_len for i, r in enumerate(requests)}
    final_len = {str(i): r.total_len for i, r in enumerate(requests)}
    for i, r in enumerate(requests):
        sched.add_request(make_request(sched, str(i), r, policy, settings.max_model_len))
    timeline = KVTimeline()
    generated = 0
    while sched.has_unfinished_requests():
        if timeline.steps >= max_steps:
            raise RuntimeError(f"simulation did not finish in {max_steps} steps")
        step = sched.schedule()
        if step.is_empty:
            raise RuntimeError("the scheduler made no progress with requests waiting")
        sched.update_from_output(step)
        timeline.sample(
            float(timeline.steps),
            kv.usage(),
            sched.num_running_seqs,
            slot_breakdown(sched, kv, final_len),
        )
        for s in step.seqs:
            if not s.needs_logits:
                continue
            req = sched.requests[s.request_id]
            seq = req.seqs[0]
            seq.token_ids.append(0)
            generated += 1
            if seq.num_output_tokens >= output_len[s.request_id]:
                sched.finish_seq(req, seq)
    return {
        "system": policy,
        "requests": len(requests),
        "generated_tokens": generated,
        "preemptions": sched.num_preemptions,
        "kv_blocks": settings.num_kv_blocks,
        **timeline.summary(),
        "timeline": timeline.series(),
    }
