"""LLMEngine and LLM on a tiny random Llama: greedy outputs equal transformers' token for
token whatever the batching, block size, chunking or preemption; aborts free every block;
bad requests are rejected with a ValueError naming the limit or field."""

from __future__ import annotations

import pytest
import torch

from hf_oracle import hf_greedy, load_hf
from pagedllm import LLM, SamplingParams
from pagedllm.errors import InvalidParameterError

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 128, (n,), generator=g).tolist() for n in (5, 17, 33, 1, 40, 9, 16)]


@pytest.fixture(scope="module")
def oracle(tiny_llama_dir, prompts) -> list[list[int]]:
    hf = load_hf(tiny_llama_dir)
    return [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]


def generate(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def assert_pool_whole(llm: LLM) -> None:
    kv = llm.engine.kv
    assert kv.allocator.num_free_blocks == kv.num_blocks
    assert not kv.tables


@pytest.mark.parametrize(
    "options",
    [
        dict(block_size=16),
        dict(block_size=1, num_kv_blocks=2000),
        dict(block_size=8, max_num_seqs=3),
        dict(block_size=32, enable_prefix_caching=False),
    ],
)
def test_batched_greedy_equals_transformers(tiny_llama_dir, prompts, oracle, options) -> None:
    llm = LLM(str(tiny_llama_dir), **options)
    outs = generate(llm, prompts)
    assert [o.outputs[0].token_ids for o in outs] == oracle
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert_pool_whole(llm)


def test_preemption_keeps_outputs_exact(tiny_llama_dir, prompts, oracle) -> None:
    llm = LLM(str(tiny_llama_dir), block_size=4, num_kv_blocks=24, watermark=0.0)
    outs = generate(llm, prompts)
    assert llm.engine.scheduler.num_preemptions > 0
    assert sum(o.num_preemptions for o in outs) == llm.engine.scheduler.num_preemptions
    assert [o.outputs[0].token_ids for o in outs] == oracle
    assert_pool_whole(llm)


def test_chunked_prefill_keeps_outputs_exact(tiny_llama_dir, prompts, oracle) -> None:
    llm = LLM(str(tiny_llama_dir), block_size=8, max_num_batched_tokens=6)
    outs = generate(llm, prompts)
    # 40-token prompt under a 6-token budget: at least 7 steps before its first token.
    assert llm.engine.stats.steps >= 40 // 6 + GREEDY.max_tokens
    assert [o.outputs[0].token_ids for o in outs] == oracle
    assert_pool_whole(llm)


def test_abort_frees_every_block(tiny_llama_dir, prompts) -> None:
    llm = LLM(str(tiny_llama_dir), block_size=4)
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY)
    engine.step()
    engine.step()
    assert engine.kv.allocator.num_used_blocks > 0
    assert engine.abort("r4")
    assert not engine.abort("r4")  # already gone
    for i in range(len(prompts)):
        engine.abort(f"r{i}")
    assert not engine.has_unfinished_requests()
    assert_pool_whole(llm)


def test_over_long_and_oversized_requests_are_rejected(tiny_llama_dir) -> None:
    llm = LLM(str(tiny_llama_dir), block_size=4, num_kv_blocks=8, max_model_len=64)
    cases = [
        ([1] * 60, SamplingParams(max_tokens=10), "max_tokens", "context_length_exceeded"),
        ([1] * 64, SamplingParams(max_tokens=1), "prompt", "context_length_exceeded"),
        ([1] * 30, SamplingParams(max_tokens=10), "max_tokens", "kv_cache_exceeded"),
        ([1] * 10, SamplingParams(n=3, max_tokens=10), "n", "kv_cache_exceeded"),
        ([500], SamplingParams(), "prompt", "invalid_value"),
        ([], SamplingParams(), "prompt", "invalid_value"),
        ([1], SamplingParams(stop_token_ids=[128]), "stop_token_ids", "invalid_value"),
        ([1], SamplingParams(logit_bias={128: 1.0}), "logit_bias", "invalid_value"),
        ([1], SamplingParams(n=2, best_of=200), "best_of", "invalid_value"),
    ]
    messages = [
        r"exceeds max_model_len \(64\)",
        r"exceeds max_model_len \(64\)",
        "the pool has 8 usable blocks",
        "the pool has 8 usable blocks",
        r"prompt token id must be an integer in \[0, 127\], got 500",
        "at least one token",
        r"\[0, 127\]",
        r"\[0, 127\]",
        "best_of must be at most 128",
    ]
    for (prompt, params, param, code), message in zip(cases, messages, strict=True):
        with pytest.raises(InvalidParameterError, match=message) as info:
            llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        assert (info.value.param, info.value.code) == (param, code)
    # Nothing was left queued or allocated by the rejected requests.
    assert not llm.engine.has_unfinished_requests()
    assert_pool_whole(llm)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(temperature=-1), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(top_k=-5), "top_k"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-3), "max_tokens"),
        (dict(n=0), "n"),
        (dict(n=3, best_of=2), "best_of"),
        (dict(min_p=1.5), "min_p"),
        (dict(presence_penalty=3), "presence_penalty"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(logprobs=21), "logprobs"),
        (dict(stop=[""]), "stop"),
        (dict(min_tokens=9, max_tokens=4), "min_tokens"),
        (dict(seed=1.5), "seed"),
    ],
)
def test_invalid_sampling_params_name_the_field(kwargs, field) -> None:
    with pytest.raises(InvalidParameterError, match=rf"^{field} must be") as info:
        SamplingParams(**kwargs)
    assert info.value.param == field


def test_seeded_sampling_is_independent_of_the_batch(tiny_llama_dir, prompts) -> None:
    llm = LLM(str(tiny_llama_dir))
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=12, ignore_eos=True)
    alone = generate(llm, [prompts[1]], seeded)[0].outputs[0].token_ids
    others = SamplingParams(temperature=0.7, max_tokens=12, ignore_eos=True)
    mixed = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        [others, seeded, *[others] * (len(prompts) - 2)],
        use_tqdm=False,
    )
    assert mixed[1].outputs[0].token_ids == alone
    again = generate(llm, [prompts[1]], seeded)[0].outputs[0].token_ids
    assert again == alone


def test_seeded_generators_are_dropped_when_their_sequences_end(tiny_llama_dir, prompts) -> None:
    llm = LLM(str(tiny_llama_dir))
    engine = llm.engine
    generators = engine.runner._generators
    seeded = SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=3, ignore_eos=True)
    # Aborted, then a step with nothing to run: the ended ids wait for the next real step.
    engine.add_request("aborted", prompts[0], seeded)
    engine.step()
    assert len(generators) == 2
    engine.abort("aborted")
    assert engine.step() == []
    engine.add_request("next", prompts[1], GREEDY)
    engine.step()
    assert not generators
    engine.abort("next")
    # Finished normally: likewise dropped with the next step that runs.
    engine.add_request("done", prompts[2], seeded)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.step() == []
    engine.add_request("after", prompts[3], GREEDY)
    engine.step()
    assert not generators


def test_stop_token_ids_and_max_tokens(tiny_llama_dir, prompts, oracle) -> None:
    llm = LLM(str(tiny_llama_dir))
    stop_at = oracle[0][5]
    first = oracle[0].index(stop_at)
    out = generate(
        llm,
        [prompts[0]],
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_at]),
    )[0].outputs[0]
    assert out.token_ids == oracle[0][: first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_at)
    out = generate(llm, [prompts[0]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[
        0
    ].outputs[0]
    assert out.token_ids == oracle[0][:3] and out.finish_reason == "length"


def test_requests_that_could_stall_are_rejected_up_front(tiny_llama_dir) -> None:
    llm = LLM(str(tiny_llama_dir), max_num_batched_tokens=2)
    with pytest.raises(ValueError, match="stop_token_ids must be in"):
        generate(llm, [[1, 2]], SamplingParams(stop_token_ids=[100000]))
    with pytest.raises(ValueError, match=r"n must be at most 2 \(max_num_batched_tokens"):
        generate(llm, [[1, 2]], SamplingParams(n=4, temperature=1.0))
    baseline = LLM(str(tiny_llama_dir), kv_reservation="reserve-max", num_kv_blocks=40)
    with pytest.raises(ValueError, match="kv_reservation='reserve-max' is a one-sequence"):
        generate(baseline, [[1, 2]], SamplingParams(n=2, temperature=1.0))
    assert_pool_whole(llm)


def test_pool_sized_context_still_admits_whole_requests(tiny_llama_dir) -> None:
    # max_model_len comes from the pool; the admission watermark must not make a request
    # of that length unadmittable (reserve-max reserves all of it at once).
    for policy in ("paged", "reserve-max", "reserve-pow2"):
        llm = LLM(
            str(tiny_llama_dir),
            block_size=4,
            num_kv_blocks=30,
            watermark=0.05,
            kv_reservation=policy,
        )
        out = generate(llm, [[1, 2, 3]], SamplingParams(temperature=0, max_tokens=5))
        assert len(out[0].outputs[0].token_ids) <= 5
        unbounded = generate(llm, [[1, 2, 3]], SamplingParams(temperature=0, max_tokens=None))
        assert unbounded[0].outputs[0].finish_reason in ("stop", "length")
        assert_pool_whole(llm)
