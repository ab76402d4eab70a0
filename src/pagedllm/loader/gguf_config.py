"""A GGUF's metadata read into ModelConfig, per llama.cpp architecture.

The common keys (`{arch}.embedding_length`, `.block_count`, `.attention.head_count`, ...) give
the decoder's shape; each family adds what llama.cpp's converter writes for it, and what
llama.cpp itself assumes where the file is silent: Gemma 3's sliding-window pattern (every
sixth layer full), its local rope base (10,000) and attention scale (head_dim, or
hidden/heads for the 62-layer 27B), as in llama.cpp's `llama-model.cpp`.
"""

from __future__ import annotations

from typing import Any

from pagedllm.errors import ModelLoadError
from pagedllm.loader.gguf_metadata import GGUFMetadata, as_float
from pagedllm.model.config import ModelConfig

# llama.cpp architecture name -> ModelConfig.architecture (transformers' model_type).
GGUF_ARCHITECTURES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "phi3": "phi3",
    "gemma3": "gemma3_text",
}
# Where the file names no pattern: llama.cpp's `set_swa_pattern(6)`, one full layer in six.
GEMMA3_SWA_PATTERN = 6
GEMMA3_LOCAL_ROPE_BASE = 10_000.0
GEMMA3_27B_LAYERS = 62  # llama.cpp's LLM_TYPE_27B, whose attention scale is hidden/heads


def _rope_scaling(meta: GGUFMetadata, arch: str) -> dict[str, Any] | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    scaling: dict[str, Any] = {"rope_type": kind}
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if factor is not None:
        scaling["factor"] = as_float(factor)
    orig = meta.get(f"{arch}.rope.scaling.original_context_length")
    if orig is not None:
        scaling["original_max_position_embeddings"] = int(orig)
    for key in ("attn_factor", "yarn_beta_fast", "yarn_beta_slow"):
        value = meta.get(f"{arch}.rope.scaling.{key}")
        if value is not None:
            hf_key = {"attn_factor": "attention_factor"}.get(key, key.removeprefix("yarn_"))
            scaling[hf_key] = as_float(value)
    return scaling


def _window(meta: GGUFMetadata, arch: str) -> int | None:
    window = meta.get(f"{arch}.attention.sliding_window")
    return int(window) if window else None


def _layer_windows(meta: GGUFMetadata, arch: str, n: int) -> tuple[int | None, ...] | None:
    """Per-layer windows. Mistral and Phi-3 window every layer, as transformers does for the
    same checkpoint (llama.cpp currently turns Phi-3's window off); Llama and Qwen have none
    (Qwen's `use_sliding_window` is false in every released checkpoint and not in GGUF)."""
    window = _window(meta, arch)
    if window is None or arch not in ("mistral", "phi3", "gemma3"):
        return None
    if arch != "gemma3":
        return (window,) * n
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern")  # per layer: True = windowed
    if isinstance(pattern, list):
        if len(pattern) != n:
            raise ModelLoadError(
                f"{meta.path}: {arch}.attention.sliding_window_pattern has {len(pattern)} "
                f"entries for {n} layers"
            )
        return tuple(window if windowed else None for windowed in pattern)
    period = int(pattern) if pattern else GEMMA3_SWA_PATTERN
    return tuple(window if (i + 1) % period else None for i in range(n))


def _gemma3_fields(meta: GGUFMetadata, hidden: int, heads: int, n: int) -> dict[str, Any]:
    arch = "gemma3"
    if meta.get(f"{arch}.attn_logit_softcapping"):
        raise ModelLoadError(
            f"{meta.path}: attention logit soft-capping (attn_logit_softcapping) is not supported"
        )
    head_dim = int(meta.get(f"{arch}.attention.key_length") or 256)
    softcap = meta.get(f"{arch}.final_logit_softcapping")
    scalar = hidden // heads if n == GEMMA3_27B_LAYERS else head_dim
    local_base = meta.get(f"{arch}.rope.freq_base_swa") or GEMMA3_LOCAL_ROPE_BASE
    return dict(
        head_dim=head_dim,
        rope_theta=as_float(meta.get(f"{arch}.rope.freq_base", 1_000_000.0)),
        local_rope_theta=as_float(local_base),
        rms_norm_eps=as_float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        qk_norm=True,
        norm_offset=1.0,
        sandwich_norms=True,
        mlp_activation="gelu_tanh",
        embedding_scale=hidden**0.5,
        query_pre_attn_scalar=float(scalar),
        final_logit_softcapping=as_float(softcap) if softcap else None,
    )


def _check_rope_dims(meta: GGUFMetadata, arch: str, head_dim: int) -> None:
    rope_dims = meta.get(f"{arch}.rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:
        raise ModelLoadError(
            f"{meta.path}: partial rotary embeddings ({rope_dims} of {head_dim} dims) "
            "are not supported"
        )


def _eos_ids(meta: GGUFMetadata) -> tuple[int, ...]:
    eos_ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        token = meta.get(f"tokenizer.ggml.{key}")
        if token is not None and int(token) not in eos_ids:
            eos_ids.append(int(token))
    return tuple(eos_ids)


def gguf_architecture(meta: GGUFMetadata) -> str:
    """The file's llama.cpp architecture name; ModelLoadError if no family reads it."""
    arch = meta.require("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"{meta.path}: unsupported GGUF architecture {arch!r}; "
            f"supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    return arch


def gguf_config(meta: GGUFMetadata, tensor_shapes: dict[str, tuple[int, ...]]) -> ModelConfig:
    """The ModelConfig described by a GGUF's metadata (and which tensors it holds)."""
    arch = gguf_architecture(meta)
    hidden = int(meta.require(f"{arch}.embedding_length"))
    heads = int(meta.require(f"{arch}.attention.head_count"))
    n = int(meta.require(f"{arch}.block_count"))
    vocab = meta.get(f"{arch}.vocab_size") or meta.array_len("tokenizer.ggml.tokens")
    if not vocab and "token_embd.weight" in tensor_shapes:
        vocab = tensor_shapes["token_embd.weight"][-1]  # GGUF dims are innermost first
    if not vocab:
        raise ModelLoadError(f"{meta.path}: GGUF metadata has no vocabulary size")
    bos = meta.get("tokenizer.ggml.bos_token_id")
    fields: dict[str, Any] = dict(
        head_dim=int(meta.get(f"{arch}.attention.key_length") or hidden // heads),
        rms_norm_eps=as_float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=as_float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        qk_norm=arch == "qwen3",
    )
    if arch == "gemma3":
        fields.update(_gemma3_fields(meta, hidden, heads, n))
    _check_rope_dims(meta, arch, fields["head_dim"])
    scaling = _rope_scaling(meta, arch)
    try:
        return ModelConfig(
            architecture=GGUF_ARCHITECTURES[arch],
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(meta.require(f"{arch}.feed_forward_length")),
            num_hidden_layers=n,
            num_attention_heads=heads,
            num_key_value_heads=int(meta.get(f"{arch}.attention.head_count_kv") or heads),
            rope_scaling=tuple(sorted(scaling.items())) if scaling else None,
            max_position_embeddings=int(meta.get(f"{arch}.context_length", 2048)),
            tie_word_embeddings="output.weight" not in tensor_shapes,
            attention_bias="blk.0.attn_q.bias" in tensor_shapes
            or "blk.0.attn_qkv.bias" in tensor_shapes,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=_eos_ids(meta),
            layer_windows=_layer_windows(meta, arch, n),
            **fields,
        )
    except ValueError as exc:
        raise ModelLoadError(f"{meta.path}: {exc}") from exc
