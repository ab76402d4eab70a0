"""The KV reservation policies: what each reserves for a given request, at admission, in
the real Scheduler and KVCacheManager and in the engine (same model code, same outputs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from inspect_internals import block_table
from pagedllm.core.reservation import reserve_tokens
from pagedllm.core.scheduler import Scheduler, SchedulerConfig
from pagedllm.core.sequence import Request, Sequence
from pagedllm.engine.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.kv.manager import KVCacheManager
from pagedllm.loader import load_model
from pagedllm.sampling_params import SamplingParams

POLICIES = ("paged", "reserve-max", "reserve-pow2", "reserve-oracle")
BS = 16


@pytest.mark.parametrize(
    ("policy", "prompt", "output", "max_len", "tokens"),
    [
        ("paged", 20, 30, 256, 0),
        ("reserve-max", 20, 30, 256, 256),
        ("reserve-pow2", 20, 30, 256, 64),
        ("reserve-pow2", 20, 12, 256, 32),  # exactly a power of two: no rounding
        ("reserve-pow2", 100, 200, 320, 320),  # 512, capped at max_model_len
        ("reserve-oracle", 20, 30, 256, 50),
        ("reserve-oracle", 200, 100, 256, 256),
    ],
)
def test_reserve_tokens(policy: str, prompt: int, output: int, max_len: int, tokens: int) -> None:
    assert reserve_tokens(policy, prompt, output, max_len) == tokens


def test_unknown_policy() -> None:
    with pytest.raises(ValueError, match="kv_reservation must be one of"):
        reserve_tokens("reserve-some", 1, 1, 8)


def _scheduler(num_blocks: int, max_len: int = 256) -> Scheduler:
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=False)
    return Scheduler(SchedulerConfig(max_model_len=max_len), kv)


def _request(sched: Scheduler, rid: str, policy: str, prompt: int, output: int) -> Request:
    seq = Sequence(
        seq_id=sched.new_seq_id(), token_ids=list(range(prompt)), num_prompt_tokens=prompt
    )
    return Request(
        rid,
        [seq],
        reserve_tokens=reserve_tokens(policy, prompt, output, sched.config.max_model_len),
    )


def _blocks(sched: Scheduler, rid: str) -> int:
    return len(block_table(sched.kv, sched.requests[rid].seqs[0].seq_id))


# prompt 20, output 30 (50 tokens in all), block size 16, max_model_len 256
ADMITTED_BLOCKS = {"paged": 2, "reserve-max": 16, "reserve-pow2": 4, "reserve-oracle": 4}


@pytest.mark.parametrize("policy", POLICIES)
def test_blocks_held_over_a_request_life(policy: str) -> None:
    """Reservations take their blocks at admission and never grow; paged grows a block
    when the last one fills."""
    sched = _scheduler(64)
    sched.add_request(_request(sched, "a", policy, 20, 30))
    held = []
    while sched.has_unfinished_requests():
        step = sched.schedule()
        sched.update_from_output(step)
        req = sched.requests["a"]
        table = block_table(sched.kv, req.seqs[0].seq_id)
        held.append(len(table))
        if policy == "paged":
            assert len(table) == -(-table.num_tokens // BS)
        seq = req.seqs[0]
        seq.token_ids.append(0)
        if seq.num_output_tokens == 30:
            sched.finish_seq(req, seq)
    assert held[0] == ADMITTED_BLOCKS[policy]
    if policy == "paged":
        assert held[-1] == -(-49 // BS)  # the last token is sampled, never computed
    else:
        assert set(held) == {ADMITTED_BLOCKS[policy]}
    assert sched.kv.num_free_blocks == 64  # everything returned


@pytest.mark.parametrize(
    ("policy", "admitted"),
    [("paged", 10), ("reserve-max", 4), ("reserve-pow2", 10), ("reserve-oracle", 10)],
)
def test_how_many_fit_at_admission(policy: str, admitted: int) -> None:
    sched = _scheduler(66)
    for i in range(10):
        sched.add_request(_request(sched, str(i), policy, 20, 30))
    sched.schedule()
    assert len(sched.running) == admitted
    used = sum(_blocks(sched, r.request_id) for r in sched.running)
    assert used == admitted * ADMITTED_BLOCKS[policy]


def test_reserve_max_fills_small_pool_without_preempting() -> None:
    sched = _scheduler(40)  # two reserve-max requests (16 blocks each) at a time
    for i in range(5):
        sched.add_request(_request(sched, str(i), "reserve-max", 20, 30))
    peak = 0
    while sched.has_unfinished_requests():
        step = sched.schedule()
        sched.update_from_output(step)
        peak = max(peak, len(sched.running))
        for s in step.seqs:
            if s.needs_logits:
                req = sched.requests[s.request_id]
                req.seqs[0].token_ids.append(0)
                if req.seqs[0].num_output_tokens == 30:
                    sched.finish_seq(req, req.seqs[0])
    assert peak == 2
    assert sched.num_preemptions == 0


@pytest.fixture(scope="module")
def tiny_loaded(tiny_llama_dir: Path):
    return load_model(str(tiny_llama_dir))


def test_engine_reserves_at_admission_and_outputs_agree(tiny_loaded) -> None:
    """Every policy runs the same model code: the same greedy tokens, different blocks."""
    outputs = {}
    for policy in POLICIES:
        engine = LLMEngine(
            EngineConfig(
                block_size=BS,
                num_kv_blocks=64,
                max_model_len=256,
                kv_reservation=policy,
                enable_prefix_caching=False,
            ),
            tiny_loaded,
        )
        params = SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.0)
        engine.add_request("r", list(range(3, 23)), params)
        engine.step()  # admission and the whole 20-token prompt
        seq_id = engine.scheduler.requests["r"].seqs[0].seq_id
        assert len(block_table(engine.kv, seq_id)) == ADMITTED_BLOCKS[policy]
        tokens = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    tokens = out.outputs[0].token_ids
        outputs[policy] = tokens
        assert engine.kv.usage().used_blocks == 0
    assert len(outputs["paged"]) == 30
    assert len(set(map(tuple, outputs.values()))) == 1
