"""The real default model (SmolLM2-135M-Instruct, GGUF Q4_1) against transformers loading
the same GGUF: identical greedy continuations, token for token, whether the prompts run
alone in transformers or together in pagedllm, with preemption and with chunked prefill;
and `make run`'s answers on the default path (the file's blocks)."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.loader import load_model

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at a temperature of",
    "A haiku about autumn leaves:",
    "The quick brown fox",
    "In 1969, the first humans to walk on the Moon were",
    "To make a cup of tea, first",
    "The largest planet in the solar system is",
    "Photosynthesis is the process by which plants",
    "My favourite programming language is Python because",
    "1, 2, 3, 4, 5,",
    "The best way to learn a new language is to practise speaking it every day with native "
    "speakers, read books and newspapers, watch films with subtitles, and",
    "Q: What is the boiling point of water in Fahrenheit?\nA:",
    "Dear team, I am writing to let you know that the quarterly report",
]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def loaded():
    return load_model()


@pytest.fixture(scope="module")
def prompt_ids(loaded) -> list[list[int]]:
    return [loaded.tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def hf_model(loaded):
    """transformers loading the same GGUF: the oracle."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        loaded.hf_dir, gguf_file=loaded.gguf_file, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def oracle(hf_model, prompt_ids) -> list[list[int]]:
    """Each prompt generated alone by transformers (greedy, stopping at EOS)."""
    hf = hf_model
    eos = hf.generation_config.eos_token_id
    outs = []
    for ids in prompt_ids:
        x = torch.tensor([ids])
        y = hf.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos,
        )
        outs.append(y[0, len(ids) :].tolist())
    return outs


def run(loaded, prompt_ids, **options):
    llm = LLM(loaded=loaded, quantization="none", **options)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompt_ids],
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
        use_tqdm=False,
    )
    kv = llm.engine.kv
    assert kv.allocator.num_free_blocks == kv.num_blocks  # nothing leaked
    return llm, [o.outputs[0].token_ids for o in outs], outs


def test_config_and_capital_of_france(loaded) -> None:
    cfg = loaded.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (30, 576, 49152)
    llm = LLM(loaded=loaded, quantization="none")
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    out = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text


def test_alone_four_prompts_match_transformers(loaded, prompt_ids, oracle) -> None:
    for i in range(4):
        _, got, _ = run(loaded, [prompt_ids[i]])
        assert got[0] == oracle[i], PROMPTS[i]


def test_sixteen_prompts_batched_match_transformers(loaded, prompt_ids, oracle) -> None:
    _, got, outs = run(loaded, prompt_ids)
    assert got == oracle
    assert all(o.outputs[0].text for o in outs)


def test_preemption_keeps_outputs_exact(loaded, prompt_ids, oracle) -> None:
    llm, got, _ = run(loaded, prompt_ids, num_kv_blocks=24, watermark=0.0)
    assert llm.engine.scheduler.num_preemptions > 0
    assert got == oracle


def test_chunked_prefill_keeps_outputs_exact(loaded, prompt_ids, oracle) -> None:
    assert max(map(len, prompt_ids)) > 24
    llm, got, _ = run(loaded, prompt_ids, max_num_batched_tokens=24, block_size=8)
    # The prompts alone needed more steps than a whole-prompt prefill would take.
    assert llm.engine.stats.steps >= sum(map(len, prompt_ids)) // 24 + MAX_TOKENS
    assert got == oracle


@pytest.mark.parametrize("width", [2, 4])
def test_beam_search_matches_transformers(loaded, hf_model, prompt_ids, width) -> None:
    from pagedllm import BeamSearchParams

    hf = hf_model
    eos = hf.generation_config.eos_token_id
    llm = LLM(loaded=loaded, quantization="none")
    chosen = [prompt_ids[0], prompt_ids[14]]
    params = BeamSearchParams(beam_width=width, max_tokens=16)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in chosen], params, use_tqdm=False)
    for ids, out in zip(chosen, outs, strict=True):
        x = torch.tensor([ids])
        y = hf.generate(
            x,
            attention_mask=torch.ones_like(x),
            num_beams=width,
            do_sample=False,
            max_new_tokens=16,
            early_stopping=False,
            eos_token_id=eos,
            pad_token_id=eos,
        )
        ref = y[0, len(ids) :].tolist()
        if eos in ref:  # transformers pads finished beams
            ref = ref[: ref.index(eos) + 1]
        assert out.outputs[0].token_ids == ref
    kv = llm.engine.kv
    assert kv.allocator.num_free_blocks == kv.num_blocks


def test_stop_string_is_cut_from_the_text(loaded, prompt_ids) -> None:
    llm = LLM(loaded=loaded, quantization="none")
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    full = llm.generate(["The capital of France is"], greedy, use_tqdm=False)[0].outputs[0]
    assert "Paris" in full.text
    stop = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=["Paris"])
    out = llm.generate(["The capital of France is"], stop, use_tqdm=False)[0].outputs[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", "Paris")
    assert out.text == full.text[: full.text.index("Paris")]
    assert len(out.token_ids) < len(full.token_ids)


def test_make_run_answers_paris_and_jupiter(capsys: pytest.CaptureFixture[str]) -> None:
    """`make run`'s command as the Makefile gives it, on the default path (the file's Q4_1
    blocks): its two one-sentence answers name Paris and Jupiter. Quantized arithmetic
    judged by its answers: a change of last bits upstream can turn a near tie."""
    from pagedllm.entrypoints.cli import main

    system = "You are a helpful assistant. Answer in one short sentence."
    questions = ["What is the capital of France?", "Name the largest planet in the solar system."]
    assert main(["generate", "--chat", "--system", system, *questions]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert len(lines) == 2 and "Paris" in lines[0] and "Jupiter" in lines[1], lines
