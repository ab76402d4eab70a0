"""Speculative decoding with a draft model (`speculative_method="draft"`).

Greedy output with a draft equals greedy output without speculation, token for token (and
the transformers oracle's), on tiny random models: with the target as its own draft (every
proposal accepted, which also shows that the draft's K/V kept up with the target's through
chunking, preemption and prefix-cache hits) and with a different random model of the same
vocabulary (most proposals rejected); batched, chunked, preempted, prefix-cached, with the
pool whole after every run. Rejection sampling with the draft's own distributions keeps
the target's distribution (chi-square); seeded sampling gives the tokens of decoding
without speculation, whatever the batch; the int8 self-draft; the refusals; the server
and the bench's draft mode.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch

from hf_oracle import hf_greedy, load_hf, make_tiny_model
from inspect_internals import block_table
from live_server import NAME, build_chat_model, start_server
from pagedllm import LLM, SamplingParams
from pagedllm.engine.config import EngineConfig
from pagedllm.entrypoints.cli import build_parser, main
from pagedllm.entrypoints.engine_args import engine_options
from pagedllm.errors import InvalidParameterError, ModelLoadError
from pagedllm.worker.draft_model import draw_proposals
from pagedllm.worker.runner import SampleRow
from pagedllm.worker.spec_verify import SpecRow, SpecVerifier
from test_spec_decode_units import SAMPLED, _check_distribution, _targets

K = 4
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    base = torch.randint(0, 128, (12,), generator=g).tolist()
    other = torch.randint(0, 128, (20,), generator=g).tolist()
    return [base * 2, [*base[:5], 9], other, base[:7] + other[:9]]


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A different random model with the target's vocabulary (and one layer fewer)."""
    path = tmp_path_factory.mktemp("tiny-llama-draft")
    return make_tiny_model(path, "llama", seed=1, num_hidden_layers=1)


def draft(model: Path | str, k: int = K, **extra) -> dict:
    """Draft options, speculating with up to 7 running sequences unless `extra` says
    otherwise (the default stops at 4), so that batches are checked too."""
    return dict(
        speculative_method="draft",
        speculative_model=str(model),
        num_speculative_tokens=k,
        **{"speculative_disable_by_batch_size": 8, **extra},
    )


def run(model, prompts, params=GREEDY, llm: LLM | None = None, **options):
    llm = llm or LLM(str(model), block_size=4, **options)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.num_blocks and not kv.tables  # the pool is whole
    return [c.token_ids for o in outs for c in o.outputs], llm


@pytest.fixture(scope="module")
def plain(tiny_llama_dir, prompts) -> list[list[int]]:
    tokens = run(tiny_llama_dir, prompts)[0]
    hf = load_hf(tiny_llama_dir)
    assert tokens == [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]  # the oracle
    return tokens


CASES = {
    "batched": {},
    # Chunked prefill (proposals cut to the budget) in a pool small enough to preempt.
    "chunked_preempted": dict(max_num_batched_tokens=6, num_kv_blocks=15, watermark=0.0),
}


@pytest.mark.parametrize("options", list(CASES.values()), ids=list(CASES))
def test_self_draft_accepts_every_proposal_and_changes_no_token(
    tiny_llama_dir, prompts, plain, options
):
    tokens, llm = run(tiny_llama_dir, prompts, **draft(tiny_llama_dir), **options)
    assert tokens == plain
    snap = llm.engine.snapshot()
    # The same weights propose what the target takes: all accepted, which holds only if
    # the draft's K/V is right at every position it reads.
    assert snap.spec_proposed_tokens > 0
    assert snap.spec_accepted_tokens == snap.spec_proposed_tokens
    assert llm.engine.num_steps < sum(len(t) for t in plain)
    if options:
        assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("options", list(CASES.values()), ids=list(CASES))
def test_other_draft_is_mostly_rejected_and_changes_no_token(
    tiny_llama_dir, other_draft, prompts, plain, options
):
    # k 2: rejections come early whatever k is; fewer draft steps keep the test quick.
    tokens, llm = run(tiny_llama_dir, prompts, **draft(other_draft, k=2), **options)
    assert tokens == plain
    snap = llm.engine.snapshot()
    assert 0 <= snap.spec_accepted_tokens < snap.spec_proposed_tokens / 2
    if options:
        assert llm.engine.scheduler.num_preemptions > 0


def test_prefix_cache_hits_keep_the_draft_in_step(tiny_llama_dir, prompts, plain):
    llm = LLM(str(tiny_llama_dir), block_size=4, **draft(tiny_llama_dir))
    assert run(tiny_llama_dir, prompts, llm=llm)[0] == plain
    hits = llm.engine.scheduler.prefix_hit_tokens
    # Prompts that run on into the outputs: the hits include blocks whose draft K/V the
    # draft wrote while proposing (accepted proposals) and in its catch-up after them.
    extended = [p + t[:16] for p, t in zip(prompts, plain, strict=True)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    assert run(tiny_llama_dir, extended, params, llm=llm)[0] == [t[16:32] for t in plain]
    assert llm.engine.scheduler.prefix_hit_tokens - hits >= sum(len(p) for p in extended) // 2
    snap = llm.engine.snapshot()
    # Draft K/V read from blocks other requests wrote is right: every proposal accepted.
    assert snap.spec_accepted_tokens == snap.spec_proposed_tokens > 0


def test_a_step_checks_the_proposals_drawn_after_the_step_before(
    tiny_llama_dir, other_draft, prompts, plain
):
    """The runner proposes after a step; the next step schedules those tokens (cut to the
    room) as the chunk's last ones, and its rows check exactly them. After each step a
    table holds only the computed tokens: the lookahead slots the draft wrote into came
    back. Preempted under a small pool, with a budget that cuts proposals."""
    llm = LLM(
        str(tiny_llama_dir),
        block_size=4,
        num_kv_blocks=15,
        watermark=0.0,
        max_num_batched_tokens=6,
        **draft(other_draft, k=2),
    )
    engine, kv = llm.engine, llm.engine.kv
    execute = engine.runner.execute
    seen: list = []

    def recording(step, rows, grammar_bitmask=None, prompt_rows=()):
        sampled = execute(step, rows, grammar_bitmask, prompt_rows)
        seen.append((step, list(rows), sampled))
        return sampled

    engine.runner.execute = recording
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, GREEDY)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        for req in engine.scheduler.running:
            assert block_table(kv, req.seqs[0].seq_id).num_tokens == req.num_computed_tokens
    assert [done[str(i)] for i in range(len(prompts))] == plain
    assert kv.num_free_blocks == kv.num_blocks
    checked = 0
    proposed: dict[int, tuple[int, ...]] = {}
    for step, rows, sampled in seen:
        row_of = {r.seq_id: r for r in rows}
        for s in step.seqs:
            k = len(s.draft_token_ids)
            if k:
                assert s.token_ids[-k:] == s.draft_token_ids
                assert row_of[s.seq_id].draft_token_ids == s.draft_token_ids
                assert proposed[s.seq_id][:k] == s.draft_token_ids
                checked += 1
        proposed = {rows[i].seq_id: p for i, p in sampled.next_proposals.items()}
    assert checked == engine.snapshot().spec_checks > 0
    assert engine.scheduler.num_preemptions > 0


def test_no_proposal_is_checked_at_the_batch_size_that_stops_speculation(
    tiny_llama_dir, prompts, plain
):
    """The draft proposes after the prefill, but with two sequences running the next step
    drops those proposals (disable_by_batch_size 2): none is checked, the tokens stay."""
    options = draft(tiny_llama_dir, speculative_disable_by_batch_size=2)
    tokens, llm = run(tiny_llama_dir, prompts[:2], **options)
    assert tokens == plain[:2]
    assert llm.engine.snapshot().spec_proposed_tokens == 0


def test_int8_self_draft_changes_no_token(tiny_llama_dir, prompts, plain):
    tokens, llm = run(
        tiny_llama_dir, prompts, **draft(tiny_llama_dir, speculative_quantization="int8")
    )
    assert tokens == plain
    snap = llm.engine.snapshot()
    assert snap.spec_accepted_tokens > snap.spec_proposed_tokens / 2


def test_seeded_sampling_is_reproducible_and_batch_independent(
    tiny_llama_dir, other_draft, prompts, plain
):
    params = SamplingParams(temperature=0.8, top_k=20, max_tokens=12, ignore_eos=True, seed=7)
    options = draft(other_draft, k=3)
    alone, _ = run(tiny_llama_dir, prompts[:1], params, **options)
    batched, llm = run(tiny_llama_dir, prompts, params, **options)
    again, _ = run(tiny_llama_dir, prompts[::-1], params, **options)
    assert batched == again[::-1]
    assert batched[:1] == alone
    snap = llm.engine.snapshot()
    assert 0 < snap.spec_accepted_tokens < snap.spec_proposed_tokens
    # The tokens of decoding without speculation; with the target as its own draft,
    # drawing with the request's noise, every proposal is the token the request draws.
    assert run(tiny_llama_dir, prompts, params)[0] == batched
    self_drafted, llm = run(tiny_llama_dir, prompts, params, **draft(tiny_llama_dir, k=3))
    assert self_drafted == batched
    snap = llm.engine.snapshot()
    assert snap.spec_accepted_tokens == snap.spec_proposed_tokens > 0
    # Beside greedy requests (checked by argmax, with no q of theirs): both unchanged.
    mixed, _ = run(tiny_llama_dir, prompts, [params, *[GREEDY] * 3], **options)
    assert mixed == alone + plain[1:]


def test_rejection_sampling_with_the_drafts_distribution_keeps_the_targets() -> None:
    """Proposals drawn by the draft's own sampler, checked against its q: the output has
    the target's distribution (8 tokens, chi-square at the first and second position)."""
    logits, p = _targets()
    n = 10_000
    draft_logits = torch.randn(2, 8, generator=torch.Generator().manual_seed(21)) * 1.5
    gen = torch.Generator().manual_seed(22)
    rows = [SampleRow(0, i, SAMPLED) for i in range(n)]
    first, q0 = draw_proposals(draft_logits[0].repeat(n, 1), rows, [None] * n, gen)
    second, q1 = draw_proposals(draft_logits[1].repeat(n, 1), rows, [None] * n, gen)
    # q is the distribution the proposals came from: their frequencies follow it.
    freq = torch.bincount(torch.tensor(first), minlength=8).double() / n
    assert torch.allclose(freq, q0[0].double(), atol=0.015)
    assert q0[0][q0[0] > 0].numel() == 7  # the row's top-k applies to the draft too
    drafts = [[a, b] for a, b in zip(first, second, strict=True)]
    draft_probs = torch.stack([q0, q1], dim=1).reshape(2 * n, 8)  # row i: 2i, 2i+1
    spec = [SpecRow(SampleRow(0, i, SAMPLED), d, 0) for i, d in enumerate(drafts)]
    out = SpecVerifier(torch.Generator().manual_seed(23))(logits, spec, draft_probs)
    assert not out.row_errors
    _check_distribution(out.token_ids, drafts, p)


def test_refusals_name_the_option(tiny_llama_dir, tmp_path_factory):
    small_vocab = make_tiny_model(tmp_path_factory.mktemp("vocab-64"), "llama", vocab_size=64)
    with pytest.raises(ModelLoadError, match="speculative_model: model path"):
        LLM(str(tiny_llama_dir), **draft(tiny_llama_dir / "missing"))
    with pytest.raises(InvalidParameterError) as err:
        LLM(str(tiny_llama_dir), **draft(small_vocab))
    assert err.value.param == "speculative_model" and "vocabulary" in str(err.value)
    for kwargs, param in (
        (dict(**draft("m"), tensor_parallel_size=2), "speculative_model"),
        (dict(speculative_quantization="int8"), "speculative_quantization"),
        (
            dict(
                speculative_method="ngram",
                num_speculative_tokens=2,
                speculative_quantization="int8",
            ),
            "speculative_quantization",
        ),
        (dict(**draft("m"), speculative_quantization="int4"), "speculative_quantization"),
        (
            dict(**draft("m"), speculative_quantization="int8", dtype="bfloat16"),
            "speculative_quantization",
        ),
    ):
        with pytest.raises(InvalidParameterError) as err:
            EngineConfig(**kwargs)
        assert err.value.param == param
    gemma = make_tiny_model(
        tmp_path_factory.mktemp("tiny-gemma3-draft"),
        "gemma3",
        num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
    )
    with pytest.raises(InvalidParameterError) as err:  # window groups: refused with a way out
        LLM(str(gemma), **draft(gemma))
    assert err.value.param == "speculative_model" and "disable_hybrid" in str(err.value)


def test_flags_and_the_bench_draft_mode(tmp_path, tmp_path_factory, capsys):
    flags = ["--speculative-method", "draft", "--speculative-model", "m"]
    flags += ["--num-speculative-tokens", "3", "--speculative-quantization", "int8"]
    args = build_parser().parse_args(["generate", "hi", *flags])
    config = EngineConfig(**engine_options(args))
    spec = config.speculative_config
    assert spec is not None and (spec.method, spec.speculative_model) == ("draft", "m")
    assert spec.speculative_quantization == "int8"
    assert config.runner_options.speculative_model == "m"
    model = build_chat_model(tmp_path_factory)
    out = tmp_path / "spec"
    bench = ["bench", "spec", "--model", str(model), "--out", str(out), "--num-prompts", "1"]
    bench += ["--max-tokens", "12", "--speculative-method", "draft", "--speculative-model"]
    assert main([*bench, str(model)]) == 0
    off, self_draft = json.loads((out / "spec.json").read_text())["results"]
    assert off["mode"] == "off" and self_draft["mode"] == f"draft {model} k=4"
    assert self_draft["same_tokens"] and self_draft["acceptance_rate"] == 1.0


def test_the_server_speculates_with_a_draft(chat_model_dir, offline):
    live = start_server(chat_model_dir, draft(chat_model_dir))
    try:
        body = {"model": NAME, "prompt": "one two three one two", "max_tokens": 12}
        r = httpx.post(live.url + "/v1/completions", json={**body, "temperature": 0})
        assert r.status_code == 200, r.text
        want = offline.generate([body["prompt"]], SamplingParams(temperature=0, max_tokens=12))
        assert r.json()["choices"][0]["text"] == want[0].outputs[0].text
        assert live.metrics()["pagedllm:spec_decode_num_draft_tokens_total"] > 0
        live.assert_pool_whole()
    finally:
        live.close()


@pytest.mark.slow
def test_smollm2_int8_self_draft_greedy_equals_greedy_without_speculation():
    """The default model in float32 drafting for itself with int8 linear layers."""
    from pagedllm.loader import load_model

    loaded = load_model()
    prompt = "The capital of France is Paris. The capital of Germany is"
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    plain = LLM(loaded=loaded, quantization="none").generate([prompt], params, use_tqdm=False)
    llm = LLM(
        loaded=loaded,
        quantization="none",
        **draft("smollm2-135m", speculative_quantization="int8"),
    )
    spec = llm.generate([prompt], params, use_tqdm=False)
    assert spec[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    snap = llm.engine.snapshot()
    assert snap.spec_accepted_tokens > snap.spec_proposed_tokens / 2
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
