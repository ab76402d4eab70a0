"""Each family's `config.json` read into ModelConfig's fields.

The families share one decoder (model/llama.py) and differ in a few fields; this file
says which, and with transformers' defaults for keys a `config.json` leaves out. What a
family can set that the decoder cannot compute (partial rotary embeddings, Phi-3's
longrope, attention logit soft-capping, bidirectional attention) is refused with a
ValueError that says so (the loader turns it into a ModelLoadError).
"""

from __future__ import annotations

from typing import Any

SLIDING, FULL = "sliding_attention", "full_attention"
# model_type of multimodal checkpoints whose text model is supported on its own.
TEXT_MODEL_HINTS = {"gemma3": "gemma3_text (Gemma3ForCausalLM)"}


def _model_type(cfg: dict[str, Any]) -> str:
    model_type = cfg.get("model_type")
    if model_type is None:
        archs = cfg.get("architectures") or ["?"]
        model_type = str(archs[0]).removesuffix("ForCausalLM").lower()
    model_type = str(model_type)
    if model_type in TEXT_MODEL_HINTS:
        raise ValueError(
            f"the multimodal {model_type!r} model is not supported; its text model is "
            f"supported as {TEXT_MODEL_HINTS[model_type]}"
        )
    return model_type


def _rope(params: dict[str, Any], theta: float) -> tuple[float, dict[str, Any] | None]:
    """(rope base, scaling dict or None) of one rope parameters dict."""
    theta = float(params.get("rope_theta", theta))
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
    if scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = {}
    return theta, scaling or None


def _check_rope(model_type: str, cfg: dict[str, Any], params: dict[str, Any]) -> None:
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if float(partial) != 1.0:
        raise ValueError(
            f"partial rotary embeddings (partial_rotary_factor={partial}) are not supported"
        )
    kind = params.get("rope_type", params.get("type"))
    if model_type == "phi3" and kind in ("longrope", "su", "yarn"):
        raise ValueError(
            f"Phi-3's {kind!r} rope scaling (the long-context checkpoints) is not supported; "
            "supported: the default rope (the 4k-context checkpoints)"
        )


def _layer_types(model_type: str, cfg: dict[str, Any], n: int, window: int | None) -> list[str]:
    """Each layer's attention kind, as transformers decides it for the family."""
    types = cfg.get("layer_types")
    if model_type in ("mistral", "phi3"):  # the window, when set, is every layer's
        return [SLIDING] * n
    if types is None and model_type == "gemma3_text":
        pattern = int(cfg.get("sliding_window_pattern", 6))
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
    if types is None and model_type in ("qwen2", "qwen3"):
        first = int(cfg.get("max_window_layers", 28))
        types = [SLIDING if window is not None and i >= first else FULL for i in range(n)]
    types = list(types or [FULL] * n)
    for kind in types:
        if kind not in (SLIDING, FULL):
            raise ValueError(f"layer_types entries must be {SLIDING} or {FULL}, got {kind!r}")
    if len(types) != n:
        raise ValueError(f"layer_types has {len(types)} entries for {n} layers")
    return types


def _windows(model_type: str, cfg: dict[str, Any], n: int) -> tuple[int | None, ...] | None:
    """Per-layer attention windows (None: full attention everywhere)."""
    if model_type == "llama":  # Llama has no window, whatever the file says
        return None
    defaults = {"mistral": 4096, "qwen2": 4096, "qwen3": 4096, "gemma3_text": 4096}
    window = cfg.get("sliding_window", defaults.get(model_type))
    if model_type in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
        window = None
    types = _layer_types(model_type, cfg, n, window)
    if window is None:
        return None
    # As given: ModelConfig checks it (int() would take `true` for a window of 1).
    windows = tuple(window if kind == SLIDING else None for kind in types)
    return None if all(w is None for w in windows) else windows


def _mlp_activation(cfg: dict[str, Any], default: str) -> str:
    name = cfg.get("hidden_activation") or cfg.get("hidden_act") or default
    known = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
    if name not in known:
        raise ValueError(f"mlp activation {name!r} is not supported; supported: {', '.join(known)}")
    return known[name]


def _gemma3_fields(cfg: dict[str, Any], hidden: int) -> dict[str, Any]:
    if cfg.get("attn_logit_softcapping") is not None:
        raise ValueError("attention logit soft-capping (attn_logit_softcapping) is not supported")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("bidirectional attention (use_bidirectional_attention) is not supported")
    params = dict(cfg.get("rope_parameters") or {})
    if FULL in params or SLIDING in params:  # transformers 5: one dict per layer kind
        full, local = dict(params.get(FULL) or {}), dict(params.get(SLIDING) or {})
    else:
        full, local = {**params, **(cfg.get("rope_scaling") or {})}, {}
    for part in (full, local):
        _check_rope("gemma3_text", cfg, part)
    theta, scaling = _rope(full, float(cfg.get("rope_theta", 1_000_000.0)))
    local_theta, local_scaling = _rope(local, float(cfg.get("rope_local_base_freq", 10_000.0)))
    if local_scaling is not None:
        raise ValueError("scaled rope on the sliding-window layers is not supported")
    softcap = cfg.get("final_logit_softcapping")
    return dict(
        rope_theta=theta,
        rope_scaling=scaling,
        local_rope_theta=local_theta,
        qk_norm=True,
        norm_offset=1.0,
        sandwich_norms=True,
        mlp_activation=_mlp_activation(cfg, "gelu_pytorch_tanh"),
        embedding_scale=hidden**0.5,
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
        final_logit_softcapping=None if softcap is None else float(softcap),
        head_dim=int(cfg.get("head_dim") or 256),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
    )


def hf_config_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's fields from a transformers `config.json` dictionary (v4 and v5)."""
    model_type = _model_type(cfg)
    num_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    n = int(cfg["num_hidden_layers"])
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
    fields: dict[str, Any] = dict(
        architecture=model_type,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_hidden_layers=n,
        num_attention_heads=num_heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(cfg.get("head_dim") or hidden // num_heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(int(e) for e in eos_ids),
        layer_windows=_windows(model_type, cfg, n),
    )
    if model_type == "gemma3_text":
        fields.update(_gemma3_fields(cfg, hidden))
    else:
        # transformers 5 moves rope_theta and the scaling dict into `rope_parameters`.
        params = {**(cfg.get("rope_parameters") or {}), **(cfg.get("rope_scaling") or {})}
        _check_rope(model_type, cfg, params)
        theta, scaling = _rope(params, float(cfg.get("rope_theta", 10000.0)))
        fields.update(rope_theta=theta, rope_scaling=scaling)
        fields["qk_norm"] = model_type == "qwen3"
        fields["mlp_activation"] = _mlp_activation(cfg, "silu")
    scaling = fields["rope_scaling"]
    fields["rope_scaling"] = tuple(sorted(scaling.items())) if scaling else None
    return fields
