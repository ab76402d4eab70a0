"""A PEFT LoRA adapter's weights, loaded in float32 and checked against the base model.

Per (layer, target): A [r, in] and B [out, r] with the scaling folded into B, so that a
row's delta is B (A x). Every tensor's shape is checked against the base's linear layer,
and a tensor the adapter's config does not account for (or one it misses) is refused by
name. The rows of q_proj/k_proj need no care for a GGUF base: its loader permutes llama.cpp's
Q/K rows back to the checkpoint's order (loader/gguf_tensors.py), the order PEFT trained.
An adapter travels to the pool as `pack()`: per layer one flat run of floats, the targets
in TARGETS order, each A then B (row-major); `unpack` gives the same views back.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from pagedllm.errors import InvalidParameterError
from pagedllm.lora.peft_config import TARGETS, LoRAConfig, module_name, read_peft_config
from pagedllm.model.config import ModelConfig

WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
PEFT_PREFIX = "base_model.model."


def target_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each target's (in_features, out_features) in the base model."""
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def layer_elems(cfg: ModelConfig, r: int, targets: tuple[str, ...]) -> int:
    """Floats one layer of an adapter of rank `r` on `targets` takes."""
    shapes = target_shapes(cfg)
    return sum(r * (shapes[t][0] + shapes[t][1]) for t in targets)


@dataclass(frozen=True)
class LoRAAdapter:
    config: LoRAConfig
    # target -> [layers, r, in] and [layers, out, r] (scaling folded in; zeros on a layer
    # the adapter leaves alone)
    a: dict[str, torch.Tensor]
    b: dict[str, torch.Tensor]

    def pack(self) -> torch.Tensor:
        """[layers, layer_elems] float32: per layer each target's A then B, flattened."""
        parts = []
        for t in self.config.targets:
            layers = self.a[t].shape[0]
            parts += [self.a[t].reshape(layers, -1), self.b[t].reshape(layers, -1)]
        return torch.cat(parts, dim=1)


def unpack(
    packed: torch.Tensor, cfg: ModelConfig, r: int, targets: tuple[str, ...]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Views of `packed` [layers, >= layer_elems] as `pack` laid it out: per target
    A [layers, r, in] and B [layers, out, r]."""
    shapes = target_shapes(cfg)
    layers, at = packed.shape[0], 0
    a, b = {}, {}
    for t in targets:
        n_in, n_out = shapes[t]
        a[t] = packed[:, at : at + r * n_in].view(layers, r, n_in)
        at += r * n_in
        b[t] = packed[:, at : at + n_out * r].view(layers, n_out, r)
        at += n_out * r
    return a, b


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    folder = Path(path)
    for name in WEIGHT_FILES:
        file = folder / name
        if not file.is_file():
            continue
        try:
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(str(file))
            return torch.load(file, map_location="cpu", weights_only=True)
        except Exception as exc:  # a corrupt file: the adapter is refused, not the engine
            raise InvalidParameterError(
                "lora_path", f"LoRA adapter {path}: cannot read {name}: {exc}"
            ) from None
    raise InvalidParameterError(
        "lora_path", f"LoRA adapter {path}: no {' or '.join(WEIGHT_FILES)} in the directory"
    )


def _tensor_name(layer: int, target: str, which: str) -> str:
    return f"{PEFT_PREFIX}{module_name(layer, target)}.lora_{which}.weight"


def load_adapter(path: str, cfg: ModelConfig, max_lora_rank: int) -> LoRAAdapter:
    """The adapter at `path` (a PEFT directory) for the base `cfg`, checked; a mismatch
    raises InvalidParameterError naming the tensor (or the config's field)."""
    config, pairs = read_peft_config(path, cfg.num_hidden_layers, max_lora_rank)
    tensors = {k.replace(".default.", "."): v for k, v in _read_tensors(path).items()}
    shapes = target_shapes(cfg)
    layers, r, scale = cfg.num_hidden_layers, config.r, config.scaling
    a = {t: torch.zeros(layers, r, shapes[t][0]) for t in config.targets}
    b = {t: torch.zeros(layers, shapes[t][1], r) for t in config.targets}
    expected = set()
    for layer, target in sorted(pairs):
        n_in, n_out = shapes[target]
        for which, want, into in (("A", (r, n_in), a), ("B", (n_out, r), b)):
            name = _tensor_name(layer, target, which)
            expected.add(name)
            got = tensors.get(name)
            if got is None:
                raise InvalidParameterError(
                    "lora_path", f"LoRA adapter {path}: tensor {name} is missing"
                )
            if tuple(got.shape) != want:
                raise InvalidParameterError(
                    "lora_path",
                    f"LoRA adapter {path}: tensor {name} has shape {tuple(got.shape)}, the "
                    f"base model needs {want} (rank {r}, {target} {n_in} -> {n_out})",
                )
            into[target][layer] = got.float() * (scale if which == "B" else 1.0)
    extra = sorted(set(tensors) - expected)
    if extra:
        raise InvalidParameterError(
            "lora_path",
            f"LoRA adapter {path}: tensor {extra[0]} does not fit the base model (supported: "
            f"lora_A/lora_B of {', '.join(TARGETS)} in layers 0..{layers - 1}, as "
            "adapter_config.json names them)",
        )
    return LoRAAdapter(config, a, b)
