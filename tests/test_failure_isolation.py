"""A request's failure is its own: a failure injected into one request's row (sampling,
stop checks and detokenising, beam bookkeeping) or into the shared forward pass fails
only the requests it touched. The survivors' tokens equal an undisturbed run's, the
engine serves on, and the pool is whole at the end."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.core.sequence import Sequence
from pagedllm.engine.outputs import RequestOutput
from pagedllm.sampling_params import BeamSearchParams
from pagedllm.worker.runner import SampleRow
from pagedllm.worker.sampler import Sampler

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=12, ignore_eos=True)
PARALLEL = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
BEAM = BeamSearchParams(beam_width=2, max_tokens=6, ignore_eos=True)
PROMPTS = {
    "greedy": [3, 14, 15, 92, 65, 35],
    "seeded": [27, 18, 28, 18, 28, 45, 90, 45],
    "parallel": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
    "beam": [60, 61, 62],
    "victim": [11, 12, 13, 14],
    "victim_beam": [70, 71, 72, 73],
}
PARAMS: dict[str, Any] = {
    "greedy": GREEDY,
    "seeded": SEEDED,
    "parallel": PARALLEL,
    "beam": BEAM,
    "victim": GREEDY,
    "victim_beam": BEAM,
}


@pytest.fixture()
def llm(tiny_llama_dir) -> LLM:
    return LLM(str(tiny_llama_dir), block_size=4, num_kv_blocks=256)


def run(llm: LLM, names: list[str], *, poison: Callable[[LLM], None] | None = None) -> dict:
    """Add the named requests, optionally break something, and step to the end."""
    engine = llm.engine
    for name in names:
        engine.add_request(name, PROMPTS[name], PARAMS[name])
    if poison is not None:
        poison(llm)
    finals: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


def tokens(out: RequestOutput) -> list[list[int]]:
    return [c.token_ids for c in out.outputs]


def assert_pool_whole(llm: LLM) -> None:
    snap = llm.engine.snapshot()
    assert snap.usage.used_blocks == 0 and snap.usage.tokens_stored == 0
    assert snap.num_running == snap.num_waiting == 0
    assert not llm.engine.kv.tables


SURVIVORS = ["greedy", "seeded", "parallel", "beam"]


@pytest.fixture()
def undisturbed(llm: LLM) -> dict[str, list[list[int]]]:
    finals = run(llm, SURVIVORS)
    assert all(out.error is None for out in finals.values())
    return {name: tokens(out) for name, out in finals.items()}


def only_victim_failed(
    llm: LLM, finals: dict[str, RequestOutput], victim: str, undisturbed: dict
) -> RequestOutput:
    """The victim's final output; every other request's tokens are the undisturbed
    run's, and the pool is whole."""
    out = finals.pop(victim)
    assert out.finished and out.error is not None
    assert {name: tokens(o) for name, o in finals.items()} == undisturbed
    assert_pool_whole(llm)
    return out


def poison_params(llm: LLM) -> None:
    """A value that slipped past validation reaches the sampler: a bias on a token id far
    past the vocabulary (indexing the logits with it raises)."""
    request = llm.engine.scheduler.requests["victim"]
    request.params = dataclasses.replace(request.params)  # its own copy, not GREEDY itself
    object.__setattr__(request.params, "logit_bias", {10**6: 1.0})


def test_a_failing_sampling_row_fails_only_its_request(llm: LLM, undisturbed) -> None:
    finals = run(llm, [*SURVIVORS[:2], "victim", *SURVIVORS[2:]], poison=poison_params)
    victim = only_victim_failed(llm, finals, "victim", undisturbed)
    assert victim.error is not None and "sampling failed" in victim.error
    assert [c.finish_reason for c in victim.outputs] == ["error"]
    # The engine serves on, exactly as before.
    assert {n: tokens(o) for n, o in run(llm, SURVIVORS).items()} == undisturbed
    assert_pool_whole(llm)


def test_a_failing_stop_check_fails_only_its_request(
    llm: LLM, undisturbed, monkeypatch: pytest.MonkeyPatch
) -> None:
    output = llm.engine.output
    check_stop = output.check_stop
    victim_seqs: set[int] = set()

    def failing_check_stop(params: SamplingParams, seq: Sequence) -> None:
        if seq.seq_id in victim_seqs and seq.num_output_tokens == 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "a tokenizer fault")
        check_stop(params, seq)

    def mark_victim(llm: LLM) -> None:
        victim_seqs.update(s.seq_id for s in llm.engine.scheduler.requests["victim"].seqs)

    monkeypatch.setattr(output, "check_stop", failing_check_stop)
    finals = run(llm, ["victim", *SURVIVORS], poison=mark_victim)
    victim = only_victim_failed(llm, finals, "victim", undisturbed)
    assert victim.error is not None and victim.error.startswith("UnicodeDecodeError")
    assert len(victim.outputs[0].token_ids) == 3  # what it had when it failed


def test_a_failing_beam_step_fails_only_the_beam_search(
    llm: LLM, undisturbed, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = llm.engine
    advance = engine.results._advance_beams  # the fault goes where beams advance
    calls = []

    def failing_advance(req: Any, *args: Any) -> None:
        if req.request_id == "victim_beam":
            calls.append(1)
            if len(calls) == 2:
                raise IndexError("a beam bookkeeping fault")
        advance(req, *args)

    monkeypatch.setattr(engine.results, "_advance_beams", failing_advance)
    finals = run(llm, [*SURVIVORS, "victim_beam"])
    victim = only_victim_failed(llm, finals, "victim_beam", undisturbed)
    assert victim.error == "IndexError: a beam bookkeeping fault"


def test_a_failed_forward_pass_fails_that_steps_requests_once(
    llm: LLM, undisturbed, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = llm.engine
    runner = engine.runner
    execute = runner.execute
    failures: list[tuple[str, ...]] = []
    fourth_step = engine.num_steps + 4

    def failing_execute(
        step: Any, rows: Any, grammar_bitmask: Any = None, prompt_rows: Any = ()
    ) -> Any:
        if not failures and engine.num_steps == fourth_step:
            failures.append(step.request_ids)
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return execute(step, rows, grammar_bitmask, prompt_rows)

    monkeypatch.setattr(runner, "execute", failing_execute)
    finals = run(llm, ["victim", "parallel"])
    assert failures == [("victim", "parallel")] and set(finals) == {"victim", "parallel"}
    for out in finals.values():
        assert out.finished and out.error is not None and "illegal memory access" in out.error
    assert_pool_whole(llm)
    # Failed once: the engine serves on, and the next requests are undisturbed.
    assert {n: tokens(o) for n, o in run(llm, SURVIVORS).items()} == undisturbed
    assert_pool_whole(llm)


def row(i: int, params: SamplingParams, seed: int | None = None) -> SampleRow:
    return SampleRow(i, i, params, seed=seed, num_logprobs=2)


def test_sampler_draws_the_other_rows_exactly_when_one_fails() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    bad = SamplingParams(temperature=0.7)
    object.__setattr__(bad, "logit_bias", {999: 1.0})  # past the 50-token vocabulary
    good = [
        row(0, SamplingParams(temperature=0)),
        row(1, SamplingParams(temperature=0.8, top_k=10**9, seed=1), seed=1),  # top_k: all
        row(3, SamplingParams(temperature=1.2, min_p=0.05, seed=2), seed=2),
    ]

    def gens() -> list[torch.Generator | None]:
        return [None, torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]

    alone = Sampler()(logits, good, gens())
    g = gens()
    mixed = Sampler()(logits, [good[0], good[1], row(2, bad), good[2]], [g[0], g[1], None, g[2]])
    assert set(mixed.row_errors) == {2} and "IndexError" in mixed.row_errors[2]
    keep = [0, 1, 3]
    assert [mixed.token_ids[i] for i in keep] == alone.token_ids
    assert [mixed.logprobs[i] for i in keep] == alone.logprobs
    assert [mixed.top_ids[i] for i in keep] == alone.top_ids


def test_tiny_temperature_is_greedy() -> None:
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(1))
    rows = [row(0, SamplingParams(temperature=1e-40)), row(1, SamplingParams(temperature=0))]
    drawn = Sampler(torch.Generator().manual_seed(3))(logits, rows)
    assert drawn.token_ids == logits.argmax(dim=-1).tolist()
    assert SamplingParams(temperature=9e-6).greedy and not SamplingParams(temperature=1e-5).greedy
