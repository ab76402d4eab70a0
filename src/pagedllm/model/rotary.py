"""Rotary position embeddings, with the scaling types Llama-family configs use.

The inverse frequencies follow transformers' definitions (default, linear, llama3, yarn)
so that logits match it; cos/sin are tabulated once for every position, and the layer
ops (layer_ops.py) rotate q and k with them.
"""

from __future__ import annotations

import math

import torch

from pagedllm.model.config import ModelConfig


def _yarn(cfg: ModelConfig, inv_freq: torch.Tensor) -> tuple[torch.Tensor, float]:
    s = cfg.rope_scaling_dict
    dim, base, factor = cfg.head_dim, cfg.rope_theta, float(s["factor"])
    original = s.get("original_max_position_embeddings") or cfg.max_position_embeddings

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        if s.get("mscale") and s.get("mscale_all_dim"):
            attention_factor = mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(correction_dim(s.get("beta_fast", 32))), 0)
    high = min(math.ceil(correction_dim(s.get("beta_slow", 1))), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv = (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation
    return inv, float(attention_factor)


def _llama3(cfg: ModelConfig, inv_freq: torch.Tensor) -> torch.Tensor:
    s = cfg.rope_scaling_dict
    factor = float(s["factor"])
    low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
    original = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(medium, smoothed, scaled)


def inverse_frequencies(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim/2], attention scaling) for the config's rope type."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = cfg.rope_type
    if kind == "linear":
        return inv_freq / float(cfg.rope_scaling_dict["factor"]), 1.0
    if kind == "llama3":
        return _llama3(cfg, inv_freq), 1.0
    if kind == "yarn":
        return _yarn(cfg, inv_freq)
    # "dynamic" NTK only changes the base past the original context, which max_model_len
    # never exceeds here; within it, it is the default.
    return inv_freq, 1.0


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        inv_freq, scaling = inverse_frequencies(cfg)
        pos = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)
