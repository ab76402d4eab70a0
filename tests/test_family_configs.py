"""Reading each family's config.json: the per-layer windows and rope bases as
transformers decides them (from `layer_types`, Qwen's `use_sliding_window` and
`max_window_layers`, Gemma 3's `sliding_window_pattern`), the fields that tell the
families apart, and clear refusals of what the decoder cannot compute (Phi-3's longrope,
partial rotary embeddings, attention soft-capping, multimodal Gemma 3)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hf_oracle import TINY
from pagedllm.loader import ModelLoadError, load_model
from pagedllm.loader.hf_loader import hf_config
from pagedllm.model.config import ModelConfig

BASE = {**TINY, "num_hidden_layers": 4}


def config_of(tmp_path: Path, model_type: str, **fields: Any) -> ModelConfig:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, **BASE, **fields}))
    return hf_config(str(tmp_path))


def test_qwen_windows_follow_use_sliding_window_and_max_window_layers(tmp_path: Path) -> None:
    assert config_of(tmp_path, "qwen2", sliding_window=16).layer_windows is None
    cfg = config_of(
        tmp_path, "qwen3", use_sliding_window=True, sliding_window=16, max_window_layers=2
    )
    assert cfg.layer_windows == (None, None, 16, 16)
    assert cfg.qk_norm and not cfg.attention_bias
    assert config_of(tmp_path, "qwen3", attention_bias=True).attention_bias


def test_mistral_and_phi3_windows_cover_every_layer(tmp_path: Path) -> None:
    assert config_of(tmp_path, "mistral", sliding_window=32).layer_windows == (32,) * 4
    assert config_of(tmp_path, "mistral", sliding_window=None).layer_windows is None
    assert config_of(tmp_path, "mistral").layer_windows == (4096,) * 4  # transformers' default
    assert config_of(tmp_path, "phi3").layer_windows is None
    assert config_of(tmp_path, "phi3", sliding_window=2047).layer_windows == (2047,) * 4
    # Llama has no window, whatever the file says.
    assert config_of(tmp_path, "llama", sliding_window=8).layer_windows is None


def test_gemma3_legacy_config(tmp_path: Path) -> None:
    """A config.json as on the Hub for Gemma 3 1B: the pattern, rope_local_base_freq and a
    linear rope scaling of the global layers."""
    cfg = config_of(
        tmp_path,
        "gemma3_text",
        num_hidden_layers=12,
        sliding_window=512,
        sliding_window_pattern=6,
        rope_theta=1_000_000.0,
        rope_local_base_freq=10_000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        head_dim=16,
    )
    windows = cfg.layer_windows
    assert windows is not None
    assert [i for i, w in enumerate(windows) if w is None] == [5, 11]
    assert set(windows) == {512, None}
    assert (cfg.rope_theta, cfg.local_rope_theta, cfg.rope_type) == (1e6, 1e4, "linear")
    assert cfg.query_pre_attn_scalar == 256 and cfg.final_logit_softcapping is None
    assert cfg.tie_word_embeddings and cfg.norm_offset == 1.0


@pytest.mark.parametrize(
    ("model_type", "fields", "pattern"),
    [
        (
            "phi3",
            dict(rope_scaling={"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}),
            r"longrope.*not supported",
        ),
        ("phi3", dict(partial_rotary_factor=0.75), r"partial rotary"),
        ("gemma3_text", dict(attn_logit_softcapping=50.0), r"soft-capping"),
        ("gemma3_text", dict(use_bidirectional_attention=True), r"bidirectional"),
        ("gemma3", dict(), r"multimodal 'gemma3'.*gemma3_text"),
        ("llama", dict(hidden_act="relu"), r"activation 'relu'.*silu"),
        ("qwen3", dict(layer_types=["chunked_attention"] * 4), r"layer_types"),
        ("gpt2", dict(), r"unsupported model architecture 'gpt2'.*gemma3_text"),
    ],
)
def test_what_cannot_be_computed_is_refused(tmp_path, model_type, fields, pattern) -> None:
    with pytest.raises(ModelLoadError, match=pattern):
        config_of(tmp_path, model_type, **fields)


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        (dict(layer_windows=(8,)), "layer_windows"),
        (dict(layer_windows=(0, None)), "layer_windows"),
        (dict(mlp_activation="relu"), "mlp_activation"),
        (dict(embedding_scale=0.0), "embedding_scale"),
        (dict(final_logit_softcapping=-1.0), "final_logit_softcapping"),
    ],
)
def test_model_config_names_the_bad_field(fields, name) -> None:
    with pytest.raises(ValueError, match=name):
        ModelConfig("llama", 8, 8, 8, 2, 2, 2, 4, **fields)


def test_phi3_fused_weights_are_split(family_dir) -> None:
    loaded = load_model(str(family_dir("phi3")))
    names = set(loaded.weights)
    assert "model.layers.0.self_attn.q_proj.weight" in names
    assert "model.layers.0.mlp.up_proj.weight" in names
    assert not any("qkv_proj" in n or "gate_up_proj" in n for n in names)
