"""Prompt log-probabilities (SamplingParams.prompt_logprobs) on a tiny random Llama: equal
to transformers' log_softmax within 1e-4 with prefill chunks smaller than the prompt,
beside requests that take a prefix-cache hit (a scored request skips it), other requests
in the batch, and preemption; once in DELTA outputs, in every CUMULATIVE one and in the
FINAL_ONLY one; a fake runner's made-up values in the same shape; the parameter checked."""

from __future__ import annotations

import pytest
import torch

from hf_oracle import load_hf
from pagedllm import LLM, SamplingParams
from pagedllm.engine.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.errors import InvalidParameterError
from pagedllm.sampling_params import RequestOutputKind
from pagedllm.worker.fake_runner import FakeModelRunner
from pagedllm.worker.runner import ModelSpec

TOL = 1e-4


@pytest.fixture(scope="module")
def hf(tiny_llama_dir):
    return load_hf(tiny_llama_dir)


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_oracle(hf, prompt: list[int], scored: list[dict[int, float] | None], k: int) -> None:
    """`scored` is transformers' log_softmax of the prompt: per token after the first, its
    own log-probability and the k most likely at its position."""
    with torch.no_grad():
        lp = hf(torch.tensor([prompt])).logits[0].float().log_softmax(dim=-1)
    assert len(scored) == len(prompt) and scored[0] is None
    for t in range(1, len(prompt)):
        values, ids = lp[t - 1].topk(k)
        expected = dict(zip(ids.tolist(), values.tolist(), strict=True))
        expected[prompt[t]] = lp[t - 1, prompt[t]].item()
        entry = scored[t]
        assert entry is not None and set(entry) == set(expected), t
        assert max(abs(entry[i] - expected[i]) for i in expected) < TOL, t


def test_prompt_logprobs_equal_transformers_beside_cache_hits_and_chunks(tiny_llama_dir, hf):
    # Chunks of 8 tokens a step: every prompt below takes several.
    llm = LLM(str(tiny_llama_dir), block_size=4, max_num_batched_tokens=8, quantization="none")
    shared = random_ids(16, 1)  # four full blocks, cached by the first request
    first = llm.generate([{"prompt_token_ids": [*shared, 1, 2]}], SamplingParams(max_tokens=2))
    assert first[0].prompt_logprobs is None  # not asked for
    prompts = [[*shared, *random_ids(14, 2)], [*shared, *random_ids(5, 3)], random_ids(23, 4), [7]]
    ks = [3, None, 0, 2]
    params = [SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=k) for k in ks]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    # The unscored request with the same prefix took the hit; the scored one computed it.
    assert [o.num_cached_tokens for o in outs] == [0, 16, 0, 0]
    assert outs[1].prompt_logprobs is None
    for i in (0, 2):
        assert_oracle(hf, prompts[i], outs[i].prompt_logprobs, ks[i])
    assert outs[3].prompt_logprobs == [None]
    kv = llm.engine.kv
    assert kv.allocator.num_free_blocks == kv.num_blocks and not kv.tables


def test_prompt_logprobs_survive_preemption(tiny_llama_dir, hf) -> None:
    llm = LLM(
        str(tiny_llama_dir),
        block_size=4,
        num_kv_blocks=24,
        watermark=0.0,
        max_num_batched_tokens=8,
        quantization="none",
    )
    prompts = [random_ids(n, 10 + n) for n in (30, 21, 26, 9)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, prompt_logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    for p, out in zip(prompts, outs, strict=True):
        assert_oracle(hf, p, out.prompt_logprobs, 1)
    assert llm.engine.kv.allocator.num_free_blocks == llm.engine.kv.num_blocks


def test_prompt_logits_are_computed_a_few_rows_at_a_time(
    tiny_llama_dir, hf, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk of 16 prompt positions under a limit of 5 rows: logits of at most 5 rows at
    once, and the same values."""
    monkeypatch.setattr("pagedllm.worker.prompt_scoring.PROMPT_LOGITS_ROWS", 5)
    llm = LLM(str(tiny_llama_dir), block_size=4, max_num_batched_tokens=16, quantization="none")
    model = llm.engine.runner.model
    compute_logits = model.compute_logits
    rows: list[int] = []

    def recording(hidden: torch.Tensor) -> torch.Tensor:
        rows.append(hidden.shape[0])
        return compute_logits(hidden)

    monkeypatch.setattr(model, "compute_logits", recording)
    prompt = random_ids(30, 5)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    # Chunks of 16 and 14 positions scoring 16 and 13 tokens, each step then the rows
    # it samples (none, then the last position's).
    assert rows == [5, 5, 5, 1, 0, 5, 5, 3, 1]
    assert_oracle(hf, prompt, out.prompt_logprobs, 2)


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_prompt_logprobs_come_with_the_prompt(kind: RequestOutputKind) -> None:
    """DELTA: in the first output only; CUMULATIVE and FINAL_ONLY: in every output. The
    fake runner's values: -0.5 for each prompt token, its top tokens from the token on."""
    config = EngineConfig(block_size=4, num_kv_blocks=64, max_num_batched_tokens=3)
    engine = LLMEngine(config, runner=FakeModelRunner(ModelSpec(10, 512), token=3))
    prompt = [5, 9, 1, 4, 8, 2, 6]
    params = SamplingParams(max_tokens=4, prompt_logprobs=2, output_kind=kind)
    engine.add_request("r", prompt, params)
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    expected = [None] + [{t: -0.5, (t + 1) % 10: -1.0} for t in prompt[1:]]
    got = [o.prompt_logprobs for o in outs]
    if kind is RequestOutputKind.DELTA:
        assert got == [expected] + [None] * (len(outs) - 1) and len(outs) == 4
    else:
        assert got == [expected] * len(outs) and len(outs) == (
            1 if kind.name == "FINAL_ONLY" else 4
        )


@pytest.mark.parametrize("value", [-1, 21, 1.5, True])
def test_prompt_logprobs_is_checked(value: object) -> None:
    with pytest.raises(InvalidParameterError) as err:
        SamplingParams(prompt_logprobs=value)
    assert err.value.param == "prompt_logprobs"
