"""The sampler: greedy, temperature, top-k / top-p / min-p filters, penalties, min_tokens
suppression, seeded reproducibility and log-probabilities, checked on fixed logits and
against transformers' logits processors."""

from __future__ import annotations

import math

import pytest
import torch

from hf_oracle import load_hf
from pagedllm import LLM, SamplingParams
from pagedllm.worker.sampler import Sampler, SampleRow

LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])


def draw(params: SamplingParams, times: int = 400, **row) -> set[int]:
    sampler = Sampler(torch.Generator().manual_seed(0))
    rows = [SampleRow(0, 0, params, **row)] * times
    return set(sampler(LOGITS, rows).token_ids)


def test_greedy_and_filters_restrict_the_support() -> None:
    assert draw(SamplingParams(temperature=0)) == {0}
    assert draw(SamplingParams(temperature=1.0)) == {0, 1, 2, 3, 4, 5}
    assert draw(SamplingParams(temperature=1.0, top_k=2)) == {0, 1}
    # probs ~ [.55, .20, .12, .07, .03, .00]: the top two reach 0.75.
    assert draw(SamplingParams(temperature=1.0, top_p=0.7)) == {0, 1}
    assert draw(SamplingParams(temperature=1.0, top_p=0.01)) == {0}
    assert draw(SamplingParams(temperature=1.0, min_p=0.3)) == {0, 1}
    assert draw(SamplingParams(temperature=1.0), suppressed_ids=(0, 1)) <= {2, 3, 4, 5}
    assert draw(SamplingParams(temperature=0, logit_bias={4: 3.5})) == {4}
    assert draw(SamplingParams(temperature=1.0, logit_bias={0: -100, 1: -100})) <= {2, 3, 4, 5}


def compiled_kernels() -> object:
    from pagedllm.kernels.cpu import load_cpu_ops, missing_cpu_features

    if missing_cpu_features():
        pytest.skip("no compiled kernels here")
    return load_cpu_ops()


@pytest.mark.parametrize("kernels", ["torch", "compiled"])
def test_greedy_fast_path_reports_the_general_paths_logprobs(monkeypatch, kernels) -> None:
    ops = compiled_kernels() if kernels == "compiled" else None
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(2)) * 4
    greedy = SamplingParams(temperature=0)
    fast_calls = []
    real_greedy = Sampler._greedy

    def spy(self: Sampler, logits: torch.Tensor) -> object:
        fast_calls.append(True)
        return real_greedy(self, logits)

    monkeypatch.setattr(Sampler, "_greedy", spy)
    order = [2, 0, 1]
    fast = Sampler(kernels=ops)(logits, [SampleRow(i, i, greedy) for i in order])
    assert len(fast_calls) == 1
    # Asking for one top log-prob takes the general path (a full log-softmax).
    slow = Sampler(kernels=ops)(logits, [SampleRow(i, i, greedy, num_logprobs=1) for i in order])
    assert len(fast_calls) == 1
    assert fast.token_ids == slow.token_ids == logits.argmax(-1)[order].tolist()
    assert fast.logprobs == pytest.approx(slow.logprobs, abs=1e-5)
    assert fast.logprobs == pytest.approx([ids[0] for ids in slow.top_logprobs], abs=1e-5)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(("rows", "vocab"), [(1, 49152), (2, 1000), (5, 13), (64, 517), (1, 1)])
def test_compiled_greedy_equals_torch(threads: int, rows: int, vocab: int) -> None:
    """Exactly torch.max's tokens (the first index on ties), and its max - logsumexp
    within float tolerance, whether rows are shared out whole or cut into parts."""
    ops = compiled_kernels()
    g = torch.Generator().manual_seed(rows * vocab)
    logits = torch.randn(rows, vocab, generator=g) * 6
    logits[0, vocab // 2 :] = logits[0].max()  # a tie: the first of them wins
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        tokens, logprobs = ops.greedy_logprobs(logits)
    finally:
        torch.set_num_threads(before)
    best, want = logits.max(dim=-1)
    assert torch.equal(tokens, want)
    torch.testing.assert_close(logprobs, best - torch.logsumexp(logits, dim=-1))


def test_compiled_greedy_takes_non_finite_rows_as_torch_does() -> None:
    ops = compiled_kernels()
    inf, nan = float("inf"), float("nan")
    logits = torch.tensor(
        [
            [0.0, nan, 1.0, nan],
            [-inf, -inf, -inf, -inf],
            [1.0, inf, 2.0, 0.0],
            [-inf, 3.0, -inf, 3.0],
        ]
    )
    tokens, logprobs = ops.greedy_logprobs(logits)
    best, want = logits.max(dim=-1)
    assert tokens.tolist() == want.tolist() == [1, 0, 1, 1]
    torch.testing.assert_close(logprobs, best - torch.logsumexp(logits, dim=-1), equal_nan=True)


def test_the_callers_logits_are_never_written() -> None:
    params = SamplingParams(temperature=0, logit_bias={4: 3.5}, presence_penalty=1.0)
    for order in ([0], [0, 0]):  # rows in order (no copy made yet), and one shared row
        logits = LOGITS.clone()
        rows = [SampleRow(r, i, params, suppressed_ids=(0,)) for i, r in enumerate(order)]
        assert Sampler()(logits, rows).token_ids == [4] * len(order)
        assert torch.equal(logits, LOGITS)


def test_temperature_sharpens_the_distribution() -> None:
    sampler = Sampler(torch.Generator().manual_seed(0))
    hot = sampler(LOGITS, [SampleRow(0, 0, SamplingParams(temperature=2.0))] * 2000).token_ids
    cold = sampler(LOGITS, [SampleRow(0, 0, SamplingParams(temperature=0.3))] * 2000).token_ids
    assert hot.count(0) < cold.count(0)
    expected = torch.softmax(LOGITS[0] / 0.3, -1)[0].item()
    assert cold.count(0) / 2000 == pytest.approx(expected, abs=0.04)


def test_seeded_rows_draw_the_same_whatever_the_batch() -> None:
    params = SamplingParams(temperature=1.0, seed=5)
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))

    def seeded_tokens(extra_rows: int) -> list[int]:
        g = torch.Generator().manual_seed(5)
        rows = [SampleRow(0, 0, SamplingParams(temperature=1.0))] * extra_rows
        rows.append(SampleRow(2, 1, params))
        generators = [None] * extra_rows + [g]
        return [Sampler()(logits, rows, generators).token_ids[-1] for _ in range(10)]

    assert seeded_tokens(0) == seeded_tokens(3)


def test_penalties_follow_their_definitions() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0]])
    rows = [
        SampleRow(
            0,
            0,
            SamplingParams(temperature=0, repetition_penalty=2.0),
            prompt_ids=(0,),
            output_ids=(1,),
        ),
    ]
    from pagedllm.worker.sampler import apply_penalties

    out = apply_penalties(logits.clone(), rows)
    assert out.tolist() == [[1.0, -2.0, 0.5, 1.0]]
    rows = [
        SampleRow(
            0,
            0,
            SamplingParams(frequency_penalty=0.5, presence_penalty=0.25),
            prompt_ids=(2,),
            output_ids=(3, 3, 0),
        ),
    ]
    out = apply_penalties(logits.clone(), rows)
    # Only generated tokens count: token 3 twice (-1.0 - 0.25), token 0 once (-0.5 - 0.25).
    assert out.tolist() == [[1.25, -1.0, 0.5, -0.25]]


def test_repetition_penalty_matches_transformers(tiny_llama_dir) -> None:
    hf = load_hf(tiny_llama_dir)
    prompt = [3, 9, 27, 81 % 128, 50, 3, 9]
    x = torch.tensor([prompt])
    ref = hf.generate(
        x,
        attention_mask=torch.ones_like(x),
        max_new_tokens=15,
        do_sample=False,
        repetition_penalty=1.8,
        pad_token_id=0,
        eos_token_id=None,
    )
    llm = LLM(str(tiny_llama_dir))
    out = llm.generate(
        [{"prompt_token_ids": prompt}],
        SamplingParams(temperature=0, repetition_penalty=1.8, max_tokens=15, ignore_eos=True),
        use_tqdm=False,
    )
    assert out[0].outputs[0].token_ids == ref[0, len(prompt) :].tolist()


def test_logprobs_are_the_models_log_softmax(tiny_llama_dir) -> None:
    hf = load_hf(tiny_llama_dir)
    prompt = [5, 10, 15, 20]
    llm = LLM(str(tiny_llama_dir))
    out = llm.generate(
        [{"prompt_token_ids": prompt}],
        SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    full = torch.tensor([prompt + out.token_ids[:-1]])
    ref = torch.log_softmax(hf(full).logits[0, len(prompt) - 1 :], -1)
    assert len(out.logprobs) == 4
    total = 0.0
    for step, (token, top) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        best = ref[step].topk(3)
        assert list(top)[:3] == best.indices.tolist()
        assert top[token] == pytest.approx(ref[step, token].item(), abs=1e-4)
        total += top[token]
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-4)
    assert math.isfinite(out.cumulative_logprob)


def test_min_tokens_suppresses_stop_tokens(tiny_llama_dir) -> None:
    llm = LLM(str(tiny_llama_dir))
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": [1, 2, 3]}], greedy, use_tqdm=False)
    stop_id = first[0].outputs[0].token_ids[0]
    params = SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True, min_tokens=3, stop_token_ids=[stop_id]
    )
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False)[0].outputs[0]
    assert stop_id not in out.token_ids[:3]
    assert len(out.token_ids) >= 3
