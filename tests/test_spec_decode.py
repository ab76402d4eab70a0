"""Speculative decoding in the engine (n-gram proposals checked in one step).

Greedy output with speculation equals greedy output without, token for token, on tiny
random models whose outputs repeat (so proposals are both accepted and rejected; each
test asserts both happened): batched, chunked, prefix-cached, under preemption, on a
hybrid model (a tiny Gemma 3 with window groups), with stop tokens, stop strings, EOS,
max_tokens and log-probs. Seeded sampling with speculation is reproducible, does not
depend on the batch, and gives the same tokens as with speculation paused by batch size.
The pool is whole after every run. Requests that must not speculate
(n > 1, beam search, structured output, a large batch) do not.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hf_oracle import make_tiny_model
from inspect_internals import block_table
from pagedllm import LLM, SamplingParams
from pagedllm.engine.config import EngineConfig
from pagedllm.entrypoints.cli import build_parser
from pagedllm.entrypoints.engine_args import engine_options
from pagedllm.errors import InvalidParameterError
from pagedllm.sampling_params import BeamSearchParams, StructuredOutputs

# Speculating with up to 7 running sequences (the default stops at 4), so that batches
# are checked too.
NGRAM = dict(
    speculative_method="ngram",
    num_speculative_tokens=4,
    prompt_lookup_min=1,
    prompt_lookup_max=3,
    speculative_disable_by_batch_size=8,
)
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
GEMMA_LAYERS = ["sliding_attention", "sliding_attention", "full_attention"] * 2


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Prompts that repeat (proposals found at once) and one that does not."""
    g = torch.Generator().manual_seed(1)
    base = torch.randint(0, 128, (12,), generator=g).tolist()
    other = torch.randint(0, 128, (20,), generator=g).tolist()
    return [base * 3, base[:5] * 4 + [9], other, base[:7] + other[:9]]


def run(model, prompts, params=GREEDY, **options):
    llm = LLM(str(model), block_size=4, **options)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.num_blocks and not kv.tables  # the pool is whole
    return outs, llm


def tokens(outs) -> list[list[int]]:
    return [c.token_ids for o in outs for c in o.outputs]


def assert_accepted_and_rejected(llm: LLM) -> None:
    snap = llm.engine.snapshot()
    assert 0 < snap.spec_accepted_tokens < snap.spec_proposed_tokens
    assert 0 < snap.spec_acceptance_rate < 1
    assert 1 < snap.spec_mean_accepted_length <= 1 + NGRAM["num_speculative_tokens"]


@pytest.fixture(scope="module")
def plain(tiny_llama_dir, prompts) -> list[list[int]]:
    return tokens(run(tiny_llama_dir, prompts)[0])


@pytest.mark.parametrize(
    "options",
    [
        {},  # batched
        dict(max_num_batched_tokens=6),  # chunked prefill; proposals cut to the budget
        dict(num_kv_blocks=24, watermark=0.0, max_model_len=80),  # preemption
    ],
    ids=["batched", "chunked", "preempted"],
)
def test_greedy_equals_greedy_without_speculation(tiny_llama_dir, prompts, plain, options):
    outs, llm = run(tiny_llama_dir, prompts, **NGRAM, **options)
    assert tokens(outs) == plain
    assert_accepted_and_rejected(llm)
    # Fewer steps than tokens: several tokens per step for some sequence.
    assert llm.engine.num_steps < sum(len(t) for t in plain)
    if "num_kv_blocks" in options:
        assert llm.engine.scheduler.num_preemptions > 0


def test_prefix_cache_hashes_only_accepted_tokens(tiny_llama_dir, prompts, plain):
    llm = LLM(str(tiny_llama_dir), block_size=4, **NGRAM)
    engine, kv = llm.engine, llm.engine.kv
    params = [{"prompt_token_ids": p} for p in prompts]
    # Step by step: every cached block holds a prefix of its sequence as it stands.
    for i, p in enumerate(params):
        engine.add_request(str(i), p["prompt_token_ids"], GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
        for req in engine.scheduler.running:
            seq = req.seqs[0]
            table = block_table(kv, seq.seq_id)
            assert table.num_tokens == req.num_computed_tokens  # no rejected slot left
            assert len(table.blocks) == -(-table.num_tokens // 4)
            for j, block in enumerate(table.blocks):
                info = kv.allocator.cached_info(block)
                if info is not None:
                    assert info.token_ids == tuple(seq.token_ids[j * 4 : (j + 1) * 4])
    assert kv.num_free_blocks == kv.num_blocks
    # The outputs' blocks, cached, serve the same prompts again: same tokens.
    before = engine.scheduler.prefix_hit_tokens
    outs = llm.generate(params, GREEDY, use_tqdm=False)
    assert tokens(outs) == plain
    assert engine.scheduler.prefix_hit_tokens > before
    assert kv.num_free_blocks == kv.num_blocks


def test_hybrid_model_greedy_and_window_blocks(tmp_path_factory, prompts):
    path = make_tiny_model(
        tmp_path_factory.mktemp("tiny-gemma3-spec"),
        "gemma3",
        num_hidden_layers=6,
        layer_types=GEMMA_LAYERS,
    )
    options = dict(max_num_batched_tokens=8, num_kv_blocks=40, watermark=0.0)
    expected = tokens(run(path, prompts, **options)[0])
    outs, llm = run(path, prompts, **NGRAM, **options)
    assert tokens(outs) == expected
    assert llm.engine.kv.num_groups == 3 and llm.engine.kv.num_dropped_blocks > 0
    assert_accepted_and_rejected(llm)


def test_stops_max_tokens_and_logprobs_as_without(tiny_llama_dir, prompts, plain):
    # A stop token that the outputs reach among accepted proposals, odd max_tokens.
    stop = plain[0][7]
    for params in (
        SamplingParams(temperature=0, max_tokens=33, ignore_eos=True, stop_token_ids=[stop]),
        SamplingParams(temperature=0, max_tokens=13, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0, max_tokens=30, min_tokens=9, stop_token_ids=[stop]),
        # Penalties count the proposals before each position as output.
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.2),
    ):
        base = run(tiny_llama_dir, prompts, params)[0]
        outs, llm = run(tiny_llama_dir, prompts, params, **NGRAM)
        assert tokens(outs) == tokens(base)
        assert llm.engine.snapshot().spec_accepted_tokens > 0
        for o, b in zip(outs, base, strict=True):
            c, d = o.outputs[0], b.outputs[0]
            assert (c.finish_reason, c.stop_reason) == (d.finish_reason, d.stop_reason)
            assert c.cumulative_logprob == pytest.approx(d.cumulative_logprob, abs=1e-4)
            if params.logprobs:
                assert [sorted(x) for x in c.logprobs] == [sorted(x) for x in d.logprobs]
                for x, y in zip(c.logprobs, d.logprobs, strict=True):
                    assert [x[t] for t in sorted(x)] == pytest.approx(
                        [y[t] for t in sorted(y)], abs=1e-4
                    )


def test_stop_strings_and_eos_as_without(chat_model_dir):
    llm_plain = LLM(str(chat_model_dir), block_size=4)
    llm_spec = LLM(str(chat_model_dir), block_size=4, **NGRAM)
    text = "one two three one two three one two three one two"
    first = llm_plain.generate([text], SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)
    out = first[0].outputs[0].text
    stops = [out[len(out) // 2 : len(out) // 2 + 3]] if len(out) > 8 else []
    for params in (
        SamplingParams(temperature=0, max_tokens=30),  # EOS as it comes
        SamplingParams(temperature=0, max_tokens=30, stop=stops, include_stop_str_in_output=True),
    ):
        a = llm_plain.generate([text, "a b a b a b a"], params, use_tqdm=False)
        b = llm_spec.generate([text, "a b a b a b a"], params, use_tqdm=False)
        for x, y in zip(a, b, strict=True):
            assert (y.outputs[0].token_ids, y.outputs[0].text) == (
                x.outputs[0].token_ids,
                x.outputs[0].text,
            )
            assert y.outputs[0].finish_reason == x.outputs[0].finish_reason
    assert llm_spec.engine.snapshot().spec_proposed_tokens > 0
    kv = llm_spec.engine.kv
    assert kv.num_free_blocks == kv.num_blocks


@pytest.fixture(scope="module")
def sharp_llama_dir(tmp_path_factory) -> Path:
    """A tiny random Llama with larger weights: peaked enough at temperature 0.8 that
    n-gram proposals are sometimes accepted."""
    return make_tiny_model(tmp_path_factory.mktemp("sharp-llama"), "llama", initializer_range=0.5)


def test_seeded_sampling_is_reproducible_and_batch_independent(sharp_llama_dir, prompts):
    params = SamplingParams(temperature=0.1, top_p=0.95, max_tokens=30, ignore_eos=True, seed=7)
    alone = tokens(run(sharp_llama_dir, prompts[:1], params, **NGRAM)[0])
    outs, llm = run(sharp_llama_dir, prompts, params, **NGRAM)
    again = tokens(run(sharp_llama_dir, prompts, params, **NGRAM)[0])
    assert tokens(outs) == again
    assert tokens(outs)[:1] == alone
    assert llm.engine.snapshot().spec_accepted_tokens > 0


def test_seeded_sampling_gives_the_same_tokens_with_speculation_on_or_off(sharp_llama_dir, prompts):
    """T=0.8, seed 7: alone it speculates; beside 9 others, speculation is off by batch
    size (8 here). Its tokens are the same either way."""
    params = SamplingParams(temperature=0.8, max_tokens=40, ignore_eos=True, seed=7)
    alone, llm = run(sharp_llama_dir, prompts[:1], params, **NGRAM)
    assert llm.engine.snapshot().spec_accepted_tokens > 0
    others = [{"prompt_token_ids": prompts[1 + i % 3]} for i in range(9)]
    crowd = LLM(str(sharp_llama_dir), block_size=4, **NGRAM)
    beside = crowd.generate(
        [{"prompt_token_ids": prompts[0]}, *others],
        [params, *[SamplingParams(temperature=0.8, max_tokens=40, ignore_eos=True)] * 9],
        use_tqdm=False,
    )
    assert crowd.engine.snapshot().spec_proposed_tokens == 0
    assert tokens(beside)[0] == tokens(alone)[0]


def test_who_does_not_speculate(tiny_llama_dir, prompts):
    # n > 1 (and best_of), beam search and a large batch: no proposals at all.
    for params, options in (
        (SamplingParams(temperature=0, n=2, max_tokens=10, ignore_eos=True), {}),
        (BeamSearchParams(beam_width=2, max_tokens=8), {}),
        (GREEDY, dict(speculative_disable_by_batch_size=2)),
    ):
        llm = LLM(str(tiny_llama_dir), block_size=4, **{**NGRAM, **options})
        if isinstance(params, BeamSearchParams):
            llm.beam_search([{"prompt_token_ids": p} for p in prompts[:2]], params, False)
        else:
            llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params, use_tqdm=False)
        assert llm.engine.snapshot().spec_proposed_tokens == 0
        assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_structured_output_does_not_speculate(chat_model_dir):
    llm = LLM(str(chat_model_dir), block_size=4, **NGRAM)
    params = SamplingParams(
        temperature=0, max_tokens=20, structured_outputs=StructuredOutputs(choice=["yes", "no"])
    )
    out = llm.generate(["yes or no? yes or no? yes or no?"], params, use_tqdm=False)
    assert out[0].outputs[0].text in ("yes", "no")
    assert llm.engine.snapshot().spec_proposed_tokens == 0


def test_figures_in_metrics_and_the_generate_summary(
    tiny_llama_dir, chat_model_dir, prompts, capsys
):
    from types import SimpleNamespace

    from pagedllm.entrypoints.cli import main
    from pagedllm.entrypoints.server.metrics import EngineCollector

    _, llm = run(tiny_llama_dir, prompts, **NGRAM)
    snap = llm.engine.snapshot()
    got = {
        m.name: m.samples[0].value
        for m in EngineCollector(SimpleNamespace(snapshot=snap)).collect()  # type: ignore[arg-type]
    }
    assert got["pagedllm:spec_decode_num_drafts"] == snap.spec_checks > 0
    assert got["pagedllm:spec_decode_num_draft_tokens"] == snap.spec_proposed_tokens
    assert got["pagedllm:spec_decode_num_accepted_tokens"] == snap.spec_accepted_tokens
    assert got["pagedllm:spec_decode_acceptance_rate"] == snap.spec_acceptance_rate
    assert got["pagedllm:spec_decode_mean_accepted_length"] == snap.spec_mean_accepted_length
    assert snap.spec_mean_accepted_length == 1 + snap.spec_accepted_tokens / snap.spec_checks
    args = ["generate", "--model", str(chat_model_dir), "--json", "--max-tokens", "16"]
    args += ["--ignore-eos", "--speculative-method", "ngram", "--num-speculative-tokens", "3"]
    args += ["--prompt-lookup-min", "1", "1 2 3 1 2 3 1 2 3"]
    assert main(args) == 0
    summary = json.loads(capsys.readouterr().out)["summary"]
    assert 0 <= summary["spec_acceptance_rate"] <= 1
    # 0 when nothing was checked (a random model's output rarely repeats its prompt).
    assert summary["spec_mean_accepted_length"] == 0 or summary["spec_mean_accepted_length"] >= 1


def test_options_flags_and_refusals():
    args = build_parser().parse_args(
        [
            "generate",
            "hi",
            "--speculative-method",
            "ngram",
            "--num-speculative-tokens",
            "3",
            "--prompt-lookup-max",
            "4",
            "--speculative-disable-by-batch-size",
            "8",
        ]
    )
    config = EngineConfig(**engine_options(args)).speculative_config
    assert config is not None
    assert (config.method, config.num_speculative_tokens) == ("ngram", 3)
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (4, 4)
    assert config.disable_by_batch_size == 8
    assert EngineConfig().speculative_config is None
    for kwargs, param in (
        (
            dict(speculative_method="ngram", num_speculative_tokens=2, speculative_model="m"),
            "speculative_model",
        ),
        (dict(speculative_method="ngram"), "num_speculative_tokens"),
        (dict(num_speculative_tokens=2), "num_speculative_tokens"),
        (dict(**NGRAM, kv_reservation="reserve-max"), "speculative_method"),
    ):
        with pytest.raises(InvalidParameterError) as err:
            EngineConfig(**kwargs)
        assert err.value.param == param


@pytest.mark.slow
def test_smollm2_greedy_equals_greedy_without_speculation():
    """The default model, asked to repeat a sentence: many proposals accepted."""
    from pagedllm.loader import load_model

    loaded = load_model()
    text = "The quick brown fox jumps over the lazy dog near the river bank."
    prompts = [f"Repeat this sentence three times: {text}\n{text}\n", "The capital of France is"]
    params = SamplingParams(temperature=0, max_tokens=24)
    plain = LLM(loaded=loaded, quantization="none").generate(prompts, params, use_tqdm=False)
    llm = LLM(loaded=loaded, quantization="none", **NGRAM)
    spec = llm.generate(prompts, params, use_tqdm=False)
    assert tokens(spec) == tokens(plain)
    snap = llm.engine.snapshot()
    assert 0 < snap.spec_accepted_tokens < snap.spec_proposed_tokens
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
