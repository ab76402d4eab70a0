"""The LoRA bench's adapters: random PEFT adapters of a base, written with safetensors and
json in the format PEFT's `save_pretrained` writes (adapter_config.json, and
adapter_model.safetensors holding A [r, in] and B [out, r] of each target as
`base_model.model.model.layers.{i}.<self_attn|mlp>.<target>.lora_{A,B}.weight`), so the
bench needs no PEFT; the merged baseline (the base with W + scale * B @ A: one adapter,
no LoRA compute); and which adapter each request runs under (uniform or Zipf-skewed).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from pagedllm.errors import InvalidParameterError
from pagedllm.loader import LoadedModel
from pagedllm.lora.adapter import target_shapes
from pagedllm.lora.peft_config import module_name, read_peft_config
from pagedllm.model.config import ModelConfig
from pagedllm.worker.options import MAX_LORA_RANK

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TARGET_SETS = {"qv": ("q_proj", "v_proj"), "all": TARGETS}
DISTRIBUTIONS = ("uniform", "zipf")
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


@dataclass(frozen=True)
class AdapterSpec:
    """The shape of the bench's adapters: rank, target modules, lora_alpha, rsLoRA."""

    rank: int = 8
    targets: tuple[str, ...] = TARGET_SETS["qv"]
    alpha: int = 16
    rslora: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.rank <= MAX_LORA_RANK:
            message = f"lora_rank must be in 1..{MAX_LORA_RANK}, got {self.rank}"
            raise InvalidParameterError("lora_rank", message)
        unknown = sorted(set(self.targets) - set(TARGETS))
        if not self.targets or unknown:
            raise InvalidParameterError(
                "lora_targets", f"targets must be some of {', '.join(TARGETS)}, got {unknown}"
            )
        if self.alpha < 1:
            raise InvalidParameterError("lora_alpha", f"lora_alpha must be >= 1, got {self.alpha}")

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


def write_random_adapter(config: ModelConfig, path: str, spec: AdapterSpec, seed: int) -> str:
    """A random adapter of the base `config` in the folder `path`. Both A and B are random
    (a fresh PEFT adapter's B is zero, which would leave the output unchanged)."""
    gen = torch.Generator().manual_seed(seed)
    shapes, tensors = target_shapes(config), {}
    for layer in range(config.num_hidden_layers):
        for target in spec.targets:
            in_dim, out_dim = shapes[target]
            name = f"base_model.model.{module_name(layer, target)}"
            a = torch.randn(spec.rank, in_dim, generator=gen) / math.sqrt(in_dim)
            tensors[f"{name}.lora_A.weight"] = a
            tensors[f"{name}.lora_B.weight"] = torch.randn(out_dim, spec.rank, generator=gen) * 0.02
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, WEIGHTS_FILE), metadata={"format": "pt"})
    adapter_config = {
        "peft_type": "LORA",
        "task_type": None,
        "base_model_name_or_path": None,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "use_rslora": spec.rslora,
        "target_modules": list(spec.targets),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": False,
        "use_dora": False,
        "modules_to_save": None,
    }
    with open(os.path.join(path, CONFIG_FILE), "w", encoding="utf-8") as f:
        json.dump(adapter_config, f, indent=2)
    return path


def write_adapters(
    config: ModelConfig, folder: str, count: int, spec: AdapterSpec, seed: int = 0
) -> list[str]:
    """`count` random adapters (seeds seed, seed + 1, ...) in `folder`/adapter-<i>."""
    return [
        write_random_adapter(config, os.path.join(folder, f"adapter-{i}"), spec, seed + i)
        for i in range(count)
    ]


def merge_adapter(loaded: LoadedModel, path: str) -> LoadedModel:
    """`loaded` with the adapter at `path` merged into its weights (W + scale * B @ A):
    the same model as the base under that adapter, at the base's cost. The weights must
    be dequantized (a GGUF's blocks cannot take the sum without quantizing it again)."""
    if loaded.kept_quantized:
        raise InvalidParameterError(
            "quantization", "the merged baseline needs dequantized weights (quantization none)"
        )
    config, _ = read_peft_config(path, loaded.config.num_hidden_layers, MAX_LORA_RANK)
    scale = config.scaling
    weights = dict(loaded.weights)
    prefix = "base_model.model."
    tensors = load_file(os.path.join(path, WEIGHTS_FILE))
    for name, a in tensors.items():
        if not name.endswith(".lora_A.weight"):
            continue
        module = name[len(prefix) : -len(".lora_A.weight")]
        b = tensors[name.replace("lora_A", "lora_B")]
        base = weights[f"{module}.weight"]
        weights[f"{module}.weight"] = base + scale * (b.to(base.dtype) @ a.to(base.dtype))
    return dataclasses.replace(loaded, weights=weights)


def assign_adapters(
    num_requests: int, num_adapters: int, distribution: str, seed: int, zipf_alpha: float = 1.0
) -> list[int]:
    """The adapter (0..num_adapters-1) of each request: drawn uniformly, or by a Zipf law
    (adapter k with probability proportional to 1 / (k + 1) ** zipf_alpha: a few popular
    adapters and a long tail, as in S-LoRA's power-law workloads)."""
    if distribution not in DISTRIBUTIONS:
        raise InvalidParameterError(
            "distributions", f"distribution must be one of {', '.join(DISTRIBUTIONS)}"
        )
    if num_adapters < 1:
        raise InvalidParameterError("num_adapters", f"adapters must be >= 1, got {num_adapters}")
    rng = np.random.default_rng(seed + 2)
    if distribution == "uniform":
        return [int(k) for k in rng.integers(0, num_adapters, num_requests)]
    weights = 1.0 / np.arange(1, num_adapters + 1) ** zipf_alpha
    return [int(k) for k in rng.choice(num_adapters, num_requests, p=weights / weights.sum())]
