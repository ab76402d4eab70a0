"""The engine's read side: one immutable snapshot (with the scheduler's own admission
estimate, reservations counted) and one way to listen (step listeners, KV recorders),
on the real engine over the fake runner."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import pytest

from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.engine.config import EngineConfig
from pagedllm.engine.listeners import StepListener
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.outputs import RequestOutput
from pagedllm.engine.snapshot import EngineSnapshot
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.fake_runner import FakeModelRunner
from pagedllm.worker.runner import ModelSpec

PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)


def make_engine(**options: Any) -> LLMEngine:
    config = EngineConfig(block_size=4, num_kv_blocks=64, max_model_len=64, **options)
    return LLMEngine(config, runner=FakeModelRunner(ModelSpec(100, 4096), token=1))


@pytest.mark.parametrize(
    ("policy", "admissible"),
    [
        # 64 blocks, 3 kept as the watermark: 61 usable. 13 requests of a 10-token prompt
        # and 8 new tokens each: every policy admits a different number.
        ("paged", 13),  # 3 blocks each (the prompt): all fit
        ("reserve-max", 3),  # 16 blocks each (64 tokens)
        ("reserve-pow2", 7),  # 32 tokens = 8 blocks each
        ("reserve-oracle", 12),  # 18 tokens = 5 blocks each
    ],
)
def test_admission_estimate_counts_reservations(policy: str, admissible: int) -> None:
    engine = make_engine(kv_reservation=policy, watermark=0.05)
    for i in range(13):
        engine.add_request(f"r{i}", list(range(1, 11)), PARAMS)
    snap = engine.snapshot()
    assert (snap.num_waiting, snap.num_admissible, snap.backlog) == (
        13,
        admissible,
        13 - admissible,
    )
    engine.step()  # the scheduler admits exactly what it said it could
    assert engine.snapshot().num_running == admissible


def test_admission_estimate_counts_sequence_slots() -> None:
    engine = make_engine(max_num_seqs=5)
    engine.add_request("wide", [1, 2, 3], SamplingParams(n=4, max_tokens=4))
    engine.add_request("narrow", [1, 2, 3], SamplingParams(n=2, max_tokens=4))
    engine.add_request("one", [1, 2, 3], PARAMS)
    assert engine.snapshot().num_admissible == 1  # 4 slots, then 2 more do not fit: stop


def test_snapshot_is_immutable_and_taken_at_a_moment() -> None:
    engine = make_engine()
    engine.add_request("a", [1, 2, 3, 4, 5], PARAMS)
    before = engine.snapshot(tables=True)
    engine.step()
    after = engine.snapshot(tables=True)
    assert (before.num_running, before.num_steps, before.tables) == (0, 0, ())
    assert (after.num_running, after.num_steps, after.usage.used_blocks) == (1, 1, 2)
    ((table),) = after.tables
    assert (table.request_id, table.capacity, table.num_tokens) == ("a", 8, 5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        after.num_running = 3  # type: ignore[misc]


class Listener(StepListener):
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def on_step_begin(self, step_number: int) -> None:
        self.calls.append(("begin", step_number))

    def on_step_end(
        self, step: SchedulerOutput, outputs: Sequence[RequestOutput], ran: EngineSnapshot
    ) -> None:
        finished = [o.request_id for o in outputs if o.finished]
        self.calls.append(("end", step.request_ids, ran.usage.used_blocks, finished))

    def on_abort(self, request_id: str) -> None:
        self.calls.append(("abort", request_id))


def test_a_listener_hears_each_step_as_it_ran_and_can_leave() -> None:
    engine = make_engine()
    listener = Listener()
    remove = engine.add_listener(listener)
    engine.add_request("a", [1, 2, 3, 4], SamplingParams(max_tokens=1))
    engine.add_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 9], PARAMS)
    engine.step()
    engine.abort("b")
    # `ran` is the pool as the step ran: "a" finished in it and still held its block.
    assert listener.calls == [
        ("begin", 1),
        ("end", ("a", "b"), 1 + 3, ["a"]),
        ("abort", "b"),
    ]
    remove()
    engine.add_request("c", [1, 2], PARAMS)
    engine.step()
    assert len(listener.calls) == 3


def test_kv_hooks_only_while_a_recorder_listens_and_each_gets_every_event() -> None:
    engine = make_engine()
    assert engine.kv.listener is None
    first: list[dict[str, Any]] = []
    second: list[dict[str, Any]] = []
    one = engine.record_kv(first.append)
    two = engine.record_kv(second.append)
    engine.add_request("a", [1, 2, 3, 4, 5], SamplingParams(n=2, max_tokens=3, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    one.close()
    assert first == second and {e["k"] for r in first for e in r["ev"]} >= {"alloc", "fork"}
    assert engine.kv.listener is two
    two.close()
    assert engine.kv.listener is None and engine.kv.allocator.listener is None
