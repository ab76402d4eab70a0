"""Load a Hugging Face model directory: `config.json`, `*.safetensors` shards, tokenizer files.

Shards are found through `model.safetensors.index.json` when present, else by globbing. Weights
are converted to float32; a tied `lm_head.weight` is dropped (the model reuses the embeddings);
Phi-3's fused `qkv_proj` and `gate_up_proj` are split into the names the other families use.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any

import torch

from pagedllm.errors import ModelLoadError
from pagedllm.loader.loaded import LoadedModel, check_weights
from pagedllm.loader.tokenizer import load_hf_tokenizer
from pagedllm.model.config import SUPPORTED_ARCHITECTURES, ModelConfig
from pagedllm.model.weights import split_fused_weights

INDEX_FILE = "model.safetensors.index.json"


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: could not read JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return data


def hf_config(folder: str) -> ModelConfig:
    """The ModelConfig of a Hugging Face directory's `config.json`."""
    config_path = os.path.join(folder, "config.json")
    if not os.path.isfile(config_path):
        hint = ""
        if glob.glob(os.path.join(folder, "*.gguf")):
            hint = "; it holds .gguf files: pass the path of one of them instead"
        raise ModelLoadError(f"model directory {folder} has no config.json{hint}")
    cfg = _read_json(config_path)
    try:
        return ModelConfig.from_hf_dict(cfg)
    except ValueError as exc:
        if str(exc).startswith("unsupported architecture"):
            name = cfg.get("model_type") or cfg.get("architectures")
            raise ModelLoadError(
                f"{config_path}: unsupported model architecture {name!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            ) from exc
        raise ModelLoadError(f"{config_path}: cannot load this model config: {exc}") from exc
    except (KeyError, TypeError) as exc:
        raise ModelLoadError(f"{config_path}: invalid model config: missing {exc}") from exc


def safetensors_files(folder: str) -> list[str]:
    """The checkpoint shards of a directory, from the index file or by globbing."""
    index_path = os.path.join(folder, INDEX_FILE)
    if os.path.isfile(index_path):
        weight_map = _read_json(index_path).get("weight_map") or {}
        files = sorted({os.path.join(folder, f) for f in weight_map.values()})
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise ModelLoadError(f"{index_path}: lists shard {missing[0]} which does not exist")
    else:
        files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ModelLoadError(f"model directory {folder} has no *.safetensors weights")
    return files


def hf_weight_name(name: str, prefixed: bool) -> str | None:
    """Normalize a checkpoint key; None for entries that are not weights."""
    if name.endswith("rotary_emb.inv_freq"):
        return None
    if not prefixed and name != "lm_head.weight":
        return "model." + name  # a bare `LlamaModel` checkpoint
    return name


def load_hf_weights(folder: str) -> dict[str, torch.Tensor]:
    """All tensors of a directory's safetensors shards, as float32 CPU tensors."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    raw: dict[str, torch.Tensor] = {}
    for path in safetensors_files(folder):
        try:
            raw.update(load_file(path, device="cpu"))
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"{path}: could not read safetensors file: {exc}") from exc
    prefixed = any(k.startswith("model.") for k in raw)
    weights: dict[str, torch.Tensor] = {}
    for key, tensor in raw.items():
        name = hf_weight_name(key, prefixed)
        if name is not None:
            weights[name] = tensor if tensor.dtype == torch.float32 else tensor.float()
    return weights


def load_hf_dir(folder: str) -> LoadedModel:
    """Load a Hugging Face model directory (see the module docstring)."""
    folder = os.path.abspath(folder)
    config = hf_config(folder)
    weights = load_hf_weights(folder)
    q_size = config.num_attention_heads * config.head_dim
    kv_size = config.num_key_value_heads * config.head_dim
    split_fused_weights(weights, config.num_hidden_layers, q_size, kv_size)  # Phi-3
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    check_weights(config, weights, folder)
    return LoadedModel(
        config=config,
        weights=weights,
        tokenizer=load_hf_tokenizer(folder),
        source=folder,
        hf_dir=folder,
        gguf_file=None,
    )
