"""ModelConfig: the shape of a decoder of one of the supported families.

One frozen dataclass shared by the loaders (which fill it from `config.json` or GGUF
metadata; model/families.py reads each family's `config.json`) and the model (which
builds its layers from it). The families differ from the common decoder only in the few
fields after `eos_token_ids`: q/k norm, norm form and placement, MLP activation,
embedding scale, attention scale, a per-layer attention window and rope base, and a
logit soft cap. Validated on creation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedllm.model.families import hf_config_fields
from pagedllm.validation import check_int

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3_text")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")
MLP_ACTIVATIONS = ("silu", "gelu_tanh")
# Family fields that are None (unused) or a positive number.
OPTIONAL_POSITIVE_FIELDS = (
    "embedding_scale",
    "query_pre_attn_scalar",
    "local_rope_theta",
    "final_logit_softcapping",
)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Items of the config's rope scaling dict, as a sorted tuple so the config stays hashable.
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # --- what sets the families apart (the defaults are Llama's) ---
    # RMS norm of each head's q and k (over head_dim) before rope (Qwen3, Gemma 3).
    qk_norm: bool = False
    # Added to every norm weight: Gemma's norms scale by (1 + w).
    norm_offset: float = 0.0
    # Norms after attention and after the MLP too, before each joins the residual (Gemma 3).
    sandwich_norms: bool = False
    mlp_activation: str = "silu"  # of the gated MLP: silu (Llama) or gelu_tanh (Gemma)
    embedding_scale: float | None = None  # embeddings times this (Gemma: sqrt(hidden))
    # The attention scale is query_pre_attn_scalar ** -0.5 when set (Gemma), else
    # head_dim ** -0.5.
    query_pre_attn_scalar: float | None = None
    # Per layer: its attention window W in tokens (a query at position p sees keys in
    # (p - W, p]) or None for full attention. None: every layer attends in full.
    layer_windows: tuple[int | None, ...] | None = None
    # The rope base of the windowed layers when it differs from the full layers' (Gemma
    # 3's rope_local_base_freq); those layers use unscaled rope.
    local_rope_theta: float | None = None
    final_logit_softcapping: float | None = None  # logits = c * tanh(logits / c)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"model config {name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        rope_type = self.rope_type
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope scaling type {rope_type!r}; supported: "
                f"{', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        self._check_family_fields()

    def _check_family_fields(self) -> None:
        if self.mlp_activation not in MLP_ACTIVATIONS:
            raise ValueError(
                f"model config mlp_activation must be one of {', '.join(MLP_ACTIVATIONS)}, "
                f"got {self.mlp_activation!r}"
            )
        for name in OPTIONAL_POSITIVE_FIELDS:
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"model config {name} must be positive or None, got {value}")
        windows = self.layer_windows
        if windows is not None:
            if len(windows) != self.num_hidden_layers:
                raise ValueError(
                    f"model config layer_windows must have one entry per layer "
                    f"({self.num_hidden_layers}), got {len(windows)}"
                )
            for w in windows:
                if w is not None:
                    check_int(
                        w,
                        "layer_windows",
                        min=1,
                        allowed="None or a positive number of tokens",
                        subject="model config layer_windows entries",
                    )

    @property
    def rope_type(self) -> str:
        scaling = dict(self.rope_scaling or ())
        return str(scaling.get("rope_type", scaling.get("type", "default")))

    @property
    def rope_scaling_dict(self) -> dict[str, Any]:
        return dict(self.rope_scaling or ())

    @property
    def attention_scale(self) -> float:
        """The factor of q.k in attention."""
        if self.query_pre_attn_scalar is not None:
            return float(self.query_pre_attn_scalar) ** -0.5
        return float(self.head_dim) ** -0.5

    def layer_window(self, layer: int) -> int | None:
        """Layer `layer`'s attention window in tokens, or None (full attention)."""
        return None if self.layer_windows is None else self.layer_windows[layer]

    def uses_local_rope(self, layer: int) -> bool:
        """Whether layer `layer` rotates by `local_rope_theta` (Gemma 3's windowed layers),
        not `rope_theta`."""
        return self.local_rope_theta is not None and self.layer_window(layer) is not None

    def kv_bytes_per_token(self, element_size: int) -> int:
        """Bytes of K and V for one token across all layers, at `element_size` bytes each."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * element_size

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a transformers `config.json` dictionary (v4 and v5 layouts)."""
        return cls(**hf_config_fields(cfg))
