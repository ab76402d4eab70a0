"""The runner's penalty counts (worker/penalty_rows.py, worker/token_counts.py).

A row with repetition, frequency or presence penalties carries its sequence's tokens only
when the runner lacks their counts (new, readmitted after a preemption, a forked sample);
afterwards the runner counts each step's kept tokens itself. Outputs equal, token for
token, those of an engine whose rows carry every token at every step (the runner then
rebuilds the counts each step, as the sampler did from the ids before), on a tiny random
Llama: greedy and seeded sampling, n > 1, preemption, chunked prefill, speculation (n-gram
and a draft model). The fake runner keeps the counts too, and they equal each live
sequence's tokens after every step; the pool and the counts are empty at the end.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Any

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.engine.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.worker.fake_runner import FakeModelRunner
from pagedllm.worker.penalty_rows import ListCountStore, PenaltyRows
from pagedllm.worker.runner import ModelSpec, SampledTokens, SampleRow
from pagedllm.worker.token_counts import TensorCountStore, TokenCounts

PENALTIES = dict(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3)
GREEDY = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, **PENALTIES)
SEEDED = SamplingParams(temperature=0.9, seed=7, max_tokens=30, ignore_eos=True, **PENALTIES)
# Milder, so that proposals are both accepted and rejected.
MILD = dict(repetition_penalty=1.05, frequency_penalty=-0.1, presence_penalty=0.05)
SPEC_GREEDY = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, **MILD)
SPEC_SEEDED = SamplingParams(temperature=0.1, seed=7, max_tokens=30, ignore_eos=True, **MILD)
NGRAM = dict(
    speculative_method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=2
)


class _Forgetful(set):
    """A RowBuilder's set of counted sequences that never keeps one: every row carries
    its sequence's tokens, as before the runner kept counts."""

    def add(self, item: Any) -> None:
        pass


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Prompts that repeat (n-gram proposals found at once) and one that does not."""
    g = torch.Generator().manual_seed(3)
    base = torch.randint(0, 128, (10,), generator=g).tolist()
    other = torch.randint(0, 128, (17,), generator=g).tolist()
    return [base * 3, other, base[:6] + other[:8]]


def generate(model, prompts, params, every_step_ids=False, **options):
    llm = LLM(str(model), block_size=4, **options)
    if every_step_ids:
        llm.engine.rows._counted = _Forgetful()
    sent: list[SampleRow] = []
    execute = llm.engine.runner.execute

    def recording(step: SchedulerOutput, rows: list[SampleRow], *args: Any) -> SampledTokens:
        sent.extend(rows)
        return execute(step, rows, *args)

    llm.engine.runner.execute = recording  # type: ignore[method-assign]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.num_blocks and not kv.tables  # the pool is whole
    # No counts outlive a sequence but those the runner hears are gone with its next step.
    assert set(llm.engine.runner.penalties.num_outputs) <= set(
        llm.engine.scheduler._finished_seq_ids
    )
    return [c.token_ids for o in outs for c in o.outputs], llm, sent


CASES = {
    "greedy": (GREEDY, {}),
    "seeded": (SEEDED, {}),
    "n3_seeded": (replace(SEEDED, n=3), {}),
    "preempted": (
        replace(SEEDED, n=2),
        dict(num_kv_blocks=30, watermark=0.0, max_model_len=64),
    ),
    "chunked": (GREEDY, dict(max_num_batched_tokens=6)),
    "ngram_greedy": (SPEC_GREEDY, NGRAM),
    "ngram_seeded": (SPEC_SEEDED, NGRAM),
}


@pytest.mark.parametrize("case", list(CASES))
def test_outputs_equal_rows_that_carry_every_token(tiny_llama_dir, prompts, case) -> None:
    params, options = CASES[case]
    want, _, every = generate(tiny_llama_dir, prompts, params, True, **options)
    got, llm, sent = generate(tiny_llama_dir, prompts, params, **options)
    assert got == want
    # The tokens went once per sequence the runner met, not with every row.
    assert all(r.prompt_ids for r in every) and not any(r.runner_counts for r in every)
    carried = [r for r in sent if not r.runner_counts]
    assert len(carried) < len(sent) // 3
    assert all(not r.prompt_ids and not r.output_ids for r in sent if r.runner_counts)
    snap = llm.engine.snapshot()
    if "preempted" in case:
        assert snap.num_preemptions > 0
        assert any(r.output_ids for r in carried)  # readmitted with its outputs
    if "ngram" in case:
        assert 0 < snap.spec_accepted_tokens < snap.spec_proposed_tokens


def test_the_penalties_change_the_outputs(tiny_llama_dir, prompts) -> None:
    """The cases above bite: without penalties the same requests draw other tokens."""
    plain = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    assert (
        generate(tiny_llama_dir, prompts, plain)[0] != generate(tiny_llama_dir, prompts, GREEDY)[0]
    )


def test_a_draft_model_proposes_under_the_runners_counts(tiny_llama_dir, prompts) -> None:
    draft = dict(
        speculative_method="draft", speculative_model=str(tiny_llama_dir), num_speculative_tokens=3
    )
    for params in (GREEDY, SEEDED):
        want = generate(tiny_llama_dir, prompts, params, True, **draft)[0]
        got, llm, _ = generate(tiny_llama_dir, prompts, params, **draft)
        assert got == want
        # The draft is the model itself: it proposes the model's own tokens, every one
        # kept, only when it counts the tokens just drawn as the model does.
        snap = llm.engine.snapshot()
        assert snap.spec_accepted_tokens == snap.spec_proposed_tokens > 0


def test_the_second_row_of_a_sequence_carries_no_tokens() -> None:
    engine = LLMEngine(
        EngineConfig(block_size=4, num_kv_blocks=64), runner=FakeModelRunner(ModelSpec(50, 256))
    )
    rows: list[list[SampleRow]] = []
    execute = engine.runner.execute

    def recording(step: SchedulerOutput, step_rows: list[SampleRow], *args: Any) -> SampledTokens:
        rows.append(list(step_rows))
        return execute(step, step_rows, *args)

    engine.runner.execute = recording  # type: ignore[method-assign]
    engine.add_request(
        "a", [5, 6, 7, 5], SamplingParams(max_tokens=4, ignore_eos=True, **PENALTIES)
    )
    while engine.has_unfinished_requests():
        engine.step()
    first, second = rows[0][0], rows[1][0]
    assert list(first.prompt_ids) == [5, 6, 7, 5] and not first.runner_counts
    assert not first.output_ids
    assert (second.prompt_ids, second.output_ids, second.runner_counts) == ((), (), True)
    assert second.num_output_tokens == 1


@pytest.mark.parametrize(
    "options",
    [
        dict(num_kv_blocks=40, watermark=0.0, max_num_batched_tokens=16),  # preempts, chunks
        dict(num_kv_blocks=200, **NGRAM),
    ],
    ids=["preempted-chunked", "ngram"],
)
def test_the_fake_runners_counts_are_each_live_sequences_tokens(options) -> None:
    """After every step, the runner's counts of each live sequence with penalties are its
    prompt's tokens and its output's counts, and no sequence gone holds any."""
    runner = FakeModelRunner(ModelSpec(20, 256), seed=4)
    engine = LLMEngine(EngineConfig(block_size=4, max_model_len=256, **options), runner=runner)
    g = torch.Generator().manual_seed(2)
    for i in range(6):
        prompt = torch.randint(0, 20, (int(torch.randint(3, 30, (1,), generator=g)),), generator=g)
        params = SamplingParams(max_tokens=12, ignore_eos=True, n=1 + i % 3, seed=i, **PENALTIES)
        engine.add_request(f"r{i}", prompt.tolist(), params if i % 4 else SamplingParams(n=2))
    store = runner.penalty_counts
    assert isinstance(store, ListCountStore)
    checked = 0
    while engine.has_unfinished_requests():
        assert not [o.error for o in engine.step() if o.error]
        live = {s.seq_id: s for r in engine.scheduler.requests.values() for s in r.seqs}
        # The runner hears of a sequence gone with the next step it runs.
        going = {*engine.scheduler._finished_seq_ids, *engine.scheduler._preempted_seq_ids}
        for seq_id, n in runner.penalties.num_outputs.items():
            if seq_id in going:
                continue
            seq = live[seq_id]
            row = runner.penalties.row_of(seq_id)
            assert row is not None and n == seq.num_output_tokens
            assert store.prompts[row] == set(seq.token_ids[: seq.num_prompt_tokens])
            assert store.outputs[row] == Counter(seq.output_token_ids)
            checked += 1
    assert checked > 50
    assert engine.scheduler.num_preemptions > 0 or "speculative_method" in options


def test_a_row_that_leans_on_counts_the_runner_lacks_is_refused() -> None:
    rows = PenaltyRows(ListCountStore())
    step = SchedulerOutput((), {}, (), ())
    penalised = SamplingParams(**PENALTIES)
    with pytest.raises(RuntimeError, match="holds no penalty counts"):
        rows.apply(step, [SampleRow(0, 3, penalised, runner_counts=True)])
    assert rows.apply(step, [SampleRow(0, 3, penalised, prompt_ids=(1, 2), output_ids=(4,))]) == [1]
    with pytest.raises(RuntimeError, match="hold 1"):
        rows.apply(step, [SampleRow(0, 3, penalised, runner_counts=True, num_output_tokens=2)])
    row = SampleRow(0, 3, penalised, runner_counts=True, num_output_tokens=1)
    assert rows.apply(step, [SampleRow(0, 9, SamplingParams()), row]) == [0, 1]
    # Gone with its sequence: a preemption drops it, its row is reused by the next.
    assert rows.apply(SchedulerOutput((), {}, (), (), preempted_seq_ids=(3,)), []) == []
    assert not rows.num_outputs
    assert rows.apply(step, [SampleRow(0, 5, penalised, prompt_ids=(7,))]) == [1]


def test_the_tensor_store_counts_as_the_ids_do() -> None:
    store = TensorCountStore(8, torch.device("cpu"))
    store.build(2, [1, 1, 3], [0, 4, 4])
    store.add([2, 2, 1], [4, 5, 6])
    got = store.gather([2, 0, 1])
    want = TokenCounts.of_ids([[1, 3], [], []], [[0, 4, 4, 4, 5], [], [6]], 8, torch.device("cpu"))
    assert torch.equal(got.in_prompt, want.in_prompt) and torch.equal(got.counts, want.counts)
    assert got.counts[0].tolist() == [1, 0, 0, 0, 3, 1, 0, 0]
    store.clear(2)
    assert not store.gather([2]).in_prompt.any() and not store.gather([2]).counts.any()
