"""A PEFT LoRA adapter's `adapter_config.json`, read and checked against the base model.

What the engine serves: plain LoRA (no DoRA, no bias, no saved modules, one rank and
alpha for every module) on any subset of the seven linear layers of a Llama-like decoder
layer (TARGETS), optionally on some layers only (`layers_to_transform`). `target_modules`
is a list of module names (a name or a dotted suffix of one) or a regex PEFT matches in
full against each module's name; a target outside TARGETS is refused by name. Scaling is
lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA. Plain Python: the fake runner sizes
adapters from this alone.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedllm.errors import InvalidParameterError
from pagedllm.validation import check_int, is_int

# The decoder layer's linear layers, in the order an adapter's tensors are packed.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MODULE_PREFIX = {
    t: ("mlp." if t in ("gate_proj", "up_proj", "down_proj") else "self_attn.") for t in TARGETS
}
# Module names outside the decoder layers' TARGETS that a regex might match.
OTHER_MODULES = ("lm_head", "model.embed_tokens")
CONFIG_FILE = "adapter_config.json"


@dataclass(frozen=True)
class LoRAConfig:
    """What the engine keeps of an adapter_config.json."""

    r: int
    lora_alpha: float
    use_rslora: bool
    targets: tuple[str, ...]  # in TARGETS order
    layers: tuple[int, ...]  # the layers the adapter changes

    @property
    def scaling(self) -> float:
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)


def module_name(layer: int, target: str) -> str:
    """The base model's module name PEFT matches `target_modules` against."""
    return f"model.layers.{layer}.{MODULE_PREFIX[target]}{target}"


def _refuse(path: str, message: str) -> InvalidParameterError:
    return InvalidParameterError("lora_path", f"LoRA adapter {path}: {message}")


def _targets(raw: Any, num_layers: int, path: str) -> set[tuple[int, str]]:
    """The (layer, target) pairs `target_modules` names (before layers_to_transform)."""
    pairs: set[tuple[int, str]] = set()
    if isinstance(raw, str):
        try:
            pattern = re.compile(raw)
        except re.error as exc:
            raise _refuse(path, f"target_modules {raw!r} is not a valid regex: {exc}") from None
        for other in OTHER_MODULES:
            if pattern.fullmatch(other):
                raise _refuse(
                    path,
                    f"target_modules {raw!r} matches {other!r}; supported: {', '.join(TARGETS)}",
                )
        pairs = {
            (i, t)
            for i in range(num_layers)
            for t in TARGETS
            if pattern.fullmatch(module_name(i, t))
        }
    elif isinstance(raw, list) and all(isinstance(n, str) for n in raw):
        for name in raw:
            target = name.rsplit(".", 1)[-1]
            if target not in TARGETS or not module_name(0, target).endswith(name):
                raise _refuse(
                    path,
                    f"target module {name!r} is not supported; supported: {', '.join(TARGETS)}",
                )
            pairs.update((i, target) for i in range(num_layers))
    else:
        raise _refuse(path, f"target_modules must be a list of names or a regex, got {raw!r}")
    if not pairs:
        raise _refuse(path, f"target_modules {raw!r} matches no layer of the base model")
    return pairs


def _check_options(cfg: dict[str, Any], path: str) -> None:
    """Refuse the PEFT options the engine does not compute, naming each."""
    if cfg.get("peft_type", "LORA") != "LORA":
        raise _refuse(path, f"peft_type {cfg.get('peft_type')!r} is not supported (only LORA)")
    refused = {
        "fan_in_fan_out": bool(cfg.get("fan_in_fan_out")),
        "bias": cfg.get("bias", "none") not in (None, "none"),
        "modules_to_save": bool(cfg.get("modules_to_save")),
        "use_dora": bool(cfg.get("use_dora")),
        "rank_pattern": bool(cfg.get("rank_pattern")),
        "alpha_pattern": bool(cfg.get("alpha_pattern")),
        "layer_replication": bool(cfg.get("layer_replication")),
    }
    for option, on in refused.items():
        if on:
            raise _refuse(path, f"{option}={cfg.get(option)!r} is not supported")


def read_peft_config(
    path: str | Path, num_layers: int, max_lora_rank: int
) -> tuple[LoRAConfig, frozenset[tuple[int, str]]]:
    """The adapter's config at `path` (a PEFT directory) and the (layer, target) pairs it
    changes, checked: a bad file or an option outside what the engine computes raises
    InvalidParameterError("lora_path"), a rank above `max_lora_rank`
    InvalidParameterError("max_lora_rank"), each naming the value."""
    path = str(path)
    file = Path(path) / CONFIG_FILE
    try:
        cfg = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise _refuse(path, f"cannot read {CONFIG_FILE}: {exc}") from None
    if not isinstance(cfg, dict):
        raise _refuse(path, f"{CONFIG_FILE} is not a JSON object")
    _check_options(cfg, path)
    r = check_int(cfg.get("r"), "lora_path", min=1, subject=f"LoRA adapter {path}: r")
    if r > max_lora_rank:
        raise InvalidParameterError(
            "max_lora_rank",
            f"LoRA adapter {path} has rank {r}, above max_lora_rank {max_lora_rank}: raise "
            "max_lora_rank (--max-lora-rank) to at least the adapter's rank",
        )
    alpha = cfg.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float):
        raise _refuse(path, f"lora_alpha must be a number, got {alpha!r}")
    pairs = _targets(cfg.get("target_modules"), num_layers, path)
    only = cfg.get("layers_to_transform")
    if only is not None:
        layers = [only] if is_int(only) else only
        if not isinstance(layers, list) or not all(
            is_int(i) and 0 <= i < num_layers for i in layers
        ):
            raise _refuse(
                path, f"layers_to_transform must name layers 0..{num_layers - 1}, got {only!r}"
            )
        pairs = {(i, t) for i, t in pairs if i in layers}
    targets = tuple(t for t in TARGETS if any(p[1] == t for p in pairs))
    config = LoRAConfig(
        r=r,
        lora_alpha=float(alpha),
        use_rslora=bool(cfg.get("use_rslora", False)),
        targets=targets,
        layers=tuple(sorted({i for i, _ in pairs})),
    )
    return config, frozenset(pairs)
