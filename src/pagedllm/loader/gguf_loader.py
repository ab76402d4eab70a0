"""Load a llama.cpp GGUF file: config from its metadata, dequantized weights, its tokenizer.

Tensors are dequantized with `gguf.quants` to float32 and renamed to Hugging Face Llama names.
llama.cpp's converter permutes the rows of Q and K (llama/mistral only) for its rotary layout;
`unpermute_rows` undoes that so the weights equal the original checkpoint's.
"""

from __future__ import annotations

import os
import re
from typing import Any

import gguf
import numpy as np
import torch

from pagedllm.errors import ModelLoadError
from pagedllm.loader.loaded import LoadedModel, check_weights
from pagedllm.loader.tokenizer import load_gguf_tokenizer
from pagedllm.model.config import ModelConfig

# What this loader reads; the other supported families load from Hugging Face directories.
GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2")
HF_ONLY_ARCHITECTURES = ("qwen3", "phi3", "gemma3", "gemma3_text")
# Architectures whose Q/K rows llama.cpp's converter permutes (LlamaModel and its subclasses).
PERMUTED_ARCHITECTURES = ("llama", "mistral")

TOP_LEVEL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_TOP_RE = re.compile(r"(\w+)\.(weight|bias)")


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name for a GGUF tensor name, or None if it has no counterpart."""
    if m := _LAYER_RE.fullmatch(gguf_name):
        layer, part, kind = m.groups()
        sub = LAYER_NAMES.get(part)
        return None if sub is None else f"model.layers.{layer}.{sub}.{kind}"
    if m := _TOP_RE.fullmatch(gguf_name):
        top = TOP_LEVEL_NAMES.get(m.group(1))
        return None if top is None else f"{top}.{m.group(2)}"
    return None


def unpermute_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute` of Q/K rows (works for weights and biases)."""
    head_dim = weight.shape[0] // n_head
    w = weight.reshape(n_head, head_dim // 2, 2, *weight.shape[1:])
    return w.swapaxes(1, 2).reshape(weight.shape)


class _FastGGUFReader(gguf.GGUFReader):
    """GGUFReader over a plain-ndarray view of its memory map: parses metadata ~3x faster.

    The reader slices `self.data` once per metadata item (~250k for a 49k-token vocabulary);
    `np.memmap` slicing pays Python overhead each time, a plain view of the same map does not.
    """

    @property  # type: ignore[override]
    def data(self) -> np.ndarray:
        return self._plain_data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._plain_data = value.view(np.ndarray) if isinstance(value, np.memmap) else value


def _value(field: Any) -> Any:
    """A scalar or string metadata value of a `gguf.ReaderField`."""
    part = field.parts[field.data[0]]
    if field.types and field.types[0] == gguf.GGUFValueType.STRING:
        return bytes(part).decode("utf-8")
    return part[0].item()


def _float(value: Any) -> float:
    """A float32 metadata value as the decimal it was written from (9.99e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


class _Metadata:
    """Typed access to a GGUF's key/value metadata."""

    def __init__(self, reader: Any, path: str) -> None:
        self.fields = reader.fields
        self.path = path

    def get(self, key: str, default: Any = None) -> Any:
        field = self.fields.get(key)
        return default if field is None or not field.data else _value(field)

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ModelLoadError(f"{self.path}: GGUF metadata has no {key!r}")
        return value

    def array_len(self, key: str) -> int | None:
        field = self.fields.get(key)
        return None if field is None else len(field.data)


def _rope_scaling(meta: _Metadata, arch: str) -> dict[str, Any] | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    scaling: dict[str, Any] = {"rope_type": kind}
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if factor is not None:
        scaling["factor"] = _float(factor)
    orig = meta.get(f"{arch}.rope.scaling.original_context_length")
    if orig is not None:
        scaling["original_max_position_embeddings"] = int(orig)
    for key in ("attn_factor", "yarn_beta_fast", "yarn_beta_slow"):
        value = meta.get(f"{arch}.rope.scaling.{key}")
        if value is not None:
            hf_key = {"attn_factor": "attention_factor"}.get(key, key.removeprefix("yarn_"))
            scaling[hf_key] = _float(value)
    return scaling


def gguf_config(meta: _Metadata, tensor_shapes: dict[str, tuple[int, ...]]) -> ModelConfig:
    """The ModelConfig described by a GGUF's metadata (and which tensors it holds)."""
    arch = meta.require("general.architecture")
    if arch in HF_ONLY_ARCHITECTURES:
        raise ModelLoadError(
            f"{meta.path}: GGUF files of architecture {arch!r} are not supported yet "
            f"(GGUF supports: {', '.join(GGUF_ARCHITECTURES)}); load the model's Hugging Face "
            "directory (config.json and *.safetensors) instead"
        )
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"{meta.path}: unsupported GGUF architecture {arch!r}; "
            f"supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    if meta.get(f"{arch}.attention.sliding_window"):
        raise ModelLoadError(
            f"{meta.path}: attention windows (sliding_window) in GGUF files are not supported "
            "yet; load the model's Hugging Face directory instead"
        )
    hidden = int(meta.require(f"{arch}.embedding_length"))
    heads = int(meta.require(f"{arch}.attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // heads)
    rope_dims = meta.get(f"{arch}.rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:
        raise ModelLoadError(
            f"{meta.path}: partial rotary embeddings ({rope_dims} of {head_dim} dims) "
            "are not supported"
        )
    vocab = meta.get(f"{arch}.vocab_size") or meta.array_len("tokenizer.ggml.tokens")
    if not vocab and "token_embd.weight" in tensor_shapes:
        vocab = tensor_shapes["token_embd.weight"][-1]  # GGUF dims are innermost first
    if not vocab:
        raise ModelLoadError(f"{meta.path}: GGUF metadata has no vocabulary size")
    eos_ids = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        token = meta.get(f"tokenizer.ggml.{key}")
        if token is not None and int(token) not in eos_ids:
            eos_ids.append(int(token))
    bos = meta.get("tokenizer.ggml.bos_token_id")
    scaling = _rope_scaling(meta, arch)
    try:
        return ModelConfig(
            architecture=arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(meta.require(f"{arch}.feed_forward_length")),
            num_hidden_layers=int(meta.require(f"{arch}.block_count")),
            num_attention_heads=heads,
            num_key_value_heads=int(meta.get(f"{arch}.attention.head_count_kv") or heads),
            head_dim=head_dim,
            rms_norm_eps=_float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=_float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
            rope_scaling=tuple(sorted(scaling.items())) if scaling else None,
            max_position_embeddings=int(meta.get(f"{arch}.context_length", 2048)),
            tie_word_embeddings="output.weight" not in tensor_shapes,
            attention_bias="blk.0.attn_q.bias" in tensor_shapes,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=tuple(eos_ids),
        )
    except ValueError as exc:
        raise ModelLoadError(f"{meta.path}: {exc}") from exc


def _dequantize(tensor: Any, path: str) -> np.ndarray:
    """One GGUF tensor as a float32 array in numpy (= torch) dimension order."""
    try:
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        kind = getattr(tensor.tensor_type, "name", tensor.tensor_type)
        raise ModelLoadError(f"{path}: tensor {tensor.name!r} has unsupported type {kind}") from exc
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims innermost first
    array = array.reshape(shape)
    if array.dtype != np.float32 or np.may_share_memory(array, tensor.data):
        array = array.astype(np.float32)  # copy off the read-only memory map
    return array


def load_gguf(path: str) -> LoadedModel:
    """Load a GGUF file (see the module docstring)."""
    path = os.path.abspath(path)
    try:
        reader = _FastGGUFReader(path)
    except Exception as exc:  # bad magic, truncated file, unknown value type, ...
        raise ModelLoadError(f"{path}: not a readable GGUF file: {exc}") from exc
    meta = _Metadata(reader, path)
    tensor_shapes = {t.name: tuple(int(d) for d in t.shape) for t in reader.tensors}
    config = gguf_config(meta, tensor_shapes)
    if "rope_freqs.weight" in tensor_shapes:
        raise ModelLoadError(
            f"{path}: per-dimension rope frequency factors (rope_freqs.weight, llama3-style "
            "rope scaling) are not supported in GGUF files; load the Hugging Face checkpoint"
        )
    permute = config.architecture in PERMUTED_ARCHITECTURES
    weights: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None:
            raise ModelLoadError(f"{path}: unexpected tensor {tensor.name!r}")
        array = _dequantize(tensor, path)
        if permute and ".self_attn.q_proj." in name:
            array = unpermute_rows(array, config.num_attention_heads)
        elif permute and ".self_attn.k_proj." in name:
            array = unpermute_rows(array, config.num_key_value_heads)
        weights[name] = torch.from_numpy(array)
    check_weights(config, weights, path)
    tokenizer = None
    if meta.array_len("tokenizer.ggml.tokens"):
        tokenizer = load_gguf_tokenizer(path, meta.get("tokenizer.chat_template"))
    folder, file_name = os.path.split(path)
    return LoadedModel(
        config=config,
        weights=weights,
        tokenizer=tokenizer,
        source=path,
        hf_dir=folder,
        gguf_file=file_name,
    )
