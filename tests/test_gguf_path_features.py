"""The engine's features on a GGUF kept in its blocks (quantization="gguf", what "auto" takes).

A tiny random Llama with SmolLM2's tokenizer, written as a Q8_0 GGUF: greedy tokens are
the same batched or alone, prefix-cached or not, chunked or not, speculating (n-gram, or
a draft computing on the same blocks) or not; beams and parallel samples run and free
every block; structured output follows its schema; a server answers as offline. And
(slow) Gemma 3 270M's Q4_K_M file on its blocks with its sliding-window layer groups:
batched, chunked and preempted, the greedy tokens of each prompt alone.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import httpx
import pytest
import torch

from gguf_convert import write_gguf
from live_server import NAME, start_server
from pagedllm import LLM, SamplingParams
from pagedllm.errors import InvalidParameterError, ModelLoadError
from pagedllm.loader import LoadedModel, load_model
from pagedllm.model.gguf_linear import GGUFLinear
from pagedllm.sampling_params import BeamSearchParams, StructuredOutputs

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def gguf_path(chat_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(chat_model_dir, tmp_path_factory.mktemp("chat-q8") / "chat.gguf", "Q8_0")


@pytest.fixture(scope="module")
def kept(gguf_path: Path, chat_model_dir: Path) -> LoadedModel:
    """The Q8_0 blocks, with the chat model's tokenizer (the file carries none)."""
    from transformers import AutoTokenizer

    loaded = load_model(str(gguf_path), keep_quantized=True)
    return dataclasses.replace(loaded, tokenizer=AutoTokenizer.from_pretrained(chat_model_dir))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    base = torch.randint(100, 49152, (20,), generator=g).tolist()
    other = torch.randint(100, 49152, (33,), generator=g).tolist()
    return [base * 2, [*base[:13], 7, 8, 9], other, base + other[:5]]


def _llm(kept: LoadedModel, **options) -> LLM:
    llm = LLM(loaded=kept, block_size=4, num_kv_blocks=128, **options)
    assert llm.engine.config.quantization == "gguf"
    assert isinstance(llm.engine.runner.model.layers[0].qkv, GGUFLinear)
    return llm


def _greedy(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    _assert_pool_whole(llm)
    return [list(o.outputs[0].token_ids) for o in outs]


def _assert_pool_whole(llm: LLM) -> None:
    kv = llm.engine.kv
    assert kv.allocator.num_free_blocks == kv.num_blocks


@pytest.fixture(scope="module")
def alone(kept: LoadedModel, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt's greedy tokens, one request at a time, unchunked, uncached."""
    llm = _llm(kept, enable_prefix_caching=False)
    return [_greedy(llm, [p])[0] for p in prompts]


def test_batched_equals_alone(kept, prompts, alone) -> None:
    assert _greedy(_llm(kept, enable_prefix_caching=False), prompts) == alone


def test_prefix_cached_equals_uncached(kept, prompts, alone) -> None:
    llm = _llm(kept)
    assert _greedy(llm, prompts) == alone
    assert _greedy(llm, prompts) == alone  # now from the cached blocks
    assert llm.engine.snapshot().prefix_hit_tokens > 0


def test_chunked_prefill_equals_unchunked(kept, prompts, alone) -> None:
    llm = _llm(kept, max_num_batched_tokens=8, enable_prefix_caching=False)
    assert _greedy(llm, prompts) == alone


@pytest.mark.parametrize(
    "speculation",
    [
        dict(
            speculative_method="ngram",
            num_speculative_tokens=3,
            prompt_lookup_min=1,
            prompt_lookup_max=2,
        ),
        dict(speculative_method="draft", num_speculative_tokens=3),
        dict(speculative_method="draft", num_speculative_tokens=3, speculative_quantization="gguf"),
    ],
)
def test_speculating_equals_greedy(kept, gguf_path, prompts, alone, speculation) -> None:
    if speculation["speculative_method"] == "draft":
        speculation = {**speculation, "speculative_model": str(gguf_path)}
    # the four prompts run together: speculating at that batch size too (the default stops)
    llm = _llm(kept, **speculation, speculative_disable_by_batch_size=8)
    assert _greedy(llm, prompts) == alone
    snap = llm.engine.snapshot()
    assert snap.spec_proposed_tokens > 0
    draft = llm.engine.runner.draft
    if draft is not None:  # the target's own blocks, drafting: every proposal accepted
        assert llm.engine.config.speculative_quantization == "gguf"
        assert isinstance(draft.runner.model.layers[0].qkv, GGUFLinear)
        assert snap.spec_accepted_tokens == snap.spec_proposed_tokens


def test_a_draft_without_blocks_refuses_speculative_quantization_gguf(kept, chat_model_dir) -> None:
    with pytest.raises(InvalidParameterError) as err:
        LLM(
            loaded=kept,
            speculative_model=str(chat_model_dir),
            num_speculative_tokens=2,
            speculative_quantization="gguf",
        )
    assert err.value.param == "speculative_quantization"
    assert "Hugging Face directory" in str(err.value)


def test_beams_and_parallel_samples_free_every_block(kept, prompts) -> None:
    llm = _llm(kept)
    beams = llm.generate(
        [{"prompt_token_ids": p} for p in prompts[:2]],
        BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True),
        use_tqdm=False,
    )
    assert [len(o.outputs) for o in beams] == [3, 3]
    assert all(len(c.token_ids) == 8 for o in beams for c in o.outputs)
    _assert_pool_whole(llm)
    params = SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    samples = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
    assert len(samples[0].outputs) == 4
    assert len({tuple(c.token_ids) for c in samples[0].outputs}) > 1
    _assert_pool_whole(llm)


def test_structured_output_follows_its_schema(kept) -> None:
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
        "required": ["n", "ok"],
        "additionalProperties": False,
    }
    params = SamplingParams(
        temperature=1.0,
        seed=2,
        max_tokens=60,
        structured_outputs=StructuredOutputs(json=schema),
    )
    out = _llm(kept).generate(["Answer in JSON:"], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop", out
    value = json.loads(out.text)
    assert set(value) == {"n", "ok"} and isinstance(value["ok"], bool)


def test_a_server_over_the_blocks_answers_as_offline(kept, gguf_path) -> None:
    live = start_server(gguf_path, {"quantization": "auto"}, loaded=kept)
    try:
        assert live.engine.engine.config.quantization == "gguf"
        body = {"model": NAME, "prompt": "one two three", "max_tokens": 8, "temperature": 0}
        r = httpx.post(live.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        want = _llm(kept).generate([body["prompt"]], SamplingParams(temperature=0, max_tokens=8))
        assert r.json()["choices"][0]["text"] == want[0].outputs[0].text
        live.assert_pool_whole()
    finally:
        live.close()


@pytest.mark.slow
def test_gemma3_270m_on_its_blocks_batched_chunked_and_preempted_equals_alone() -> None:
    """The hybrid KV cache (5 sliding-window layer groups and 1 full) over Q4_K/Q6_K/Q5_0
    blocks: prompts past the 512-token window, two of which cannot run at once."""
    try:
        loaded = load_model("gemma3-270m", keep_quantized=True)
    except ModelLoadError as exc:  # the package is optional
        pytest.skip(str(exc))
    layer = loaded.weights["model.layers.0.mlp.down_proj.weight"]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1000, 200000, (n,), generator=g).tolist() for n in (560, 600)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    one = LLM(loaded=loaded, block_size=16, num_kv_blocks=400, max_model_len=640)
    assert one.engine.config.quantization == "gguf" and layer.ggml_type.name.startswith("Q")
    alone = [_greedy(one, [p], params)[0] for p in prompts]
    small = LLM(
        loaded=loaded,
        block_size=16,
        num_kv_blocks=300,
        max_model_len=640,
        max_num_batched_tokens=128,
        watermark=0.0,
    )
    assert _greedy(small, prompts, params) == alone
    assert small.engine.scheduler.num_preemptions > 0
