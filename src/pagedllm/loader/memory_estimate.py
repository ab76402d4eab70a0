"""The memory a model will take, read from its file's header before any weight loads.

`read_model_header(path)` reads a GGUF's header (or a Hugging Face directory's config.json
and its safetensors headers): the config, and each tensor's values and stored bytes.
`weight_memory(header, quantization, dtype_size)` says what the weights take on each path:
* "none": every tensor dequantized to fp32 by the loader, then copied
  into the model at `dtype`: held = parameters x dtype size; while loading, the loader's
  fp32 copy lives beside the model's (parameters x 4 more);
* "gguf": linear weights and the embedding table stay the file's blocks in its memory map
  (their bytes as stored), plus a copy of each Q and K matrix whose rows llama.cpp's
  converter permuted (Llama, Mistral), plus the other tensors (norms, biases) in fp32;
* "int8": each linear layer (fused q/k/v, o, fused gate/up, down, lm_head) as int8 weights
  [out, in] and fp32 vectors (scale and sums per output, smoothing per input), the rest in
  fp32; while loading, the loader's fp32 copy and the model's fp32 copy (calibrated, then
  quantized) live together with the int8 weights. The panels the AVX2 GEMM may pack once
  per layer are not counted.
`buffer_bytes` estimates the working buffers; `MemoryEstimate` adds the KV pool, and
`check_fits` refuses an estimate above `available_memory()` (MemAvailable, or the cgroup's
limit when lower) with InsufficientMemoryError, naming the figures and what to change.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf

from pagedllm.errors import InsufficientMemoryError, ModelLoadError
from pagedllm.loader.gguf_config import gguf_config
from pagedllm.loader.gguf_loader import kept_as_blocks
from pagedllm.loader.gguf_metadata import GGUFMetadata, read_gguf
from pagedllm.loader.gguf_tensors import PERMUTED_ARCHITECTURES, hf_name
from pagedllm.loader.hf_loader import hf_config, hf_weight_name, safetensors_files
from pagedllm.model.config import ModelConfig
from pagedllm.model.gguf_linear import STORED_TYPES

GIB = 2**30
FP32 = 4
# safetensors dtype -> bytes per value
SAFETENSORS_SIZES = {
    "F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2,
    "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
}  # fmt: skip


@dataclass(frozen=True)
class TensorFacts:
    """One tensor of the file, by its Hugging Face name: values, bytes as stored, and the
    bytes of the copy the kept-blocks path makes of it (permuted Q/K rows; else 0)."""

    name: str
    values: int
    stored_bytes: int
    permuted_copy_bytes: int = 0
    kernel_type: bool = False  # a GGUF type the kept-blocks path computes on
    type_name: str = ""  # the GGUF type (Q4_K, F32, ...); "" in a Hugging Face directory
    block_quantized: bool = False  # a GGUF type of blocks with a scale (Q4_0, Q6_K, ...)

    @property
    def is_linear(self) -> bool:
        """A linear layer's weight or the embedding table: kept as blocks on the gguf path."""
        return kept_as_blocks(self.name)


@dataclass(frozen=True)
class ModelHeader:
    """What a model's files say before any weight is read."""

    config: ModelConfig
    tensors: tuple[TensorFacts, ...]
    is_gguf: bool

    @property
    def parameters(self) -> int:
        return sum(t.values for t in self.tensors)

    @property
    def keeps_blocks(self) -> bool:
        """Whether quantization="gguf" takes this model: a GGUF whose linear weights all
        have a type its kernels compute on."""
        return self.is_gguf and all(t.kernel_type for t in self.tensors if t.is_linear)


@dataclass(frozen=True)
class WeightMemory:
    """Bytes the weights hold once loaded, and the most they hold while loading."""

    held: int
    loading: int


def _gguf_header(path: str) -> ModelHeader:
    values, tensors = read_gguf(path)  # a map of the file: no tensor's bytes are read
    config = gguf_config(GGUFMetadata(values, path), {t.name: t.shape for t in tensors})
    permuted = config.architecture in PERMUTED_ARCHITECTURES
    facts = []
    for tensor in tensors:
        name = hf_name(tensor.name, config.sandwich_norms) or tensor.name
        copied = permuted and name.endswith(("q_proj.weight", "k_proj.weight"))
        nbytes = int(tensor.data.nbytes)
        kind = tensor.tensor_type
        facts.append(
            TensorFacts(
                name,
                math.prod(tensor.shape),
                nbytes,
                nbytes if copied else 0,
                kernel_type=kind in STORED_TYPES and len(tensor.shape) == 2,
                type_name=getattr(kind, "name", str(kind)),
                block_quantized=gguf.GGML_QUANT_SIZES.get(kind, (1, 0))[0] > 1,
            )
        )
    return ModelHeader(config, tuple(facts), is_gguf=True)


def _safetensors_entries(path: str) -> dict[str, dict]:
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
    except (OSError, struct.error, ValueError) as exc:
        raise ModelLoadError(f"{path}: could not read safetensors header: {exc}") from exc
    return {k: v for k, v in header.items() if k != "__metadata__"}


def _hf_header(folder: str) -> ModelHeader:
    config = hf_config(folder)
    entries: dict[str, dict] = {}
    for path in safetensors_files(folder):
        entries.update(_safetensors_entries(path))
    prefixed = any(k.startswith("model.") for k in entries)
    facts = []
    for key, entry in entries.items():
        name = hf_weight_name(key, prefixed)
        if name is None or (name == "lm_head.weight" and config.tie_word_embeddings):
            continue  # the loader drops these
        count = math.prod(entry["shape"])
        facts.append(TensorFacts(name, count, count * SAFETENSORS_SIZES.get(entry["dtype"], 4)))
    return ModelHeader(config, tuple(facts), is_gguf=False)


def read_model_header(path: str) -> ModelHeader:
    """The header of the model at `path` (a resolved .gguf file or Hugging Face folder)."""
    return _hf_header(path) if os.path.isdir(path) else _gguf_header(path)


def _int8_linear_bytes(config: ModelConfig) -> int:
    """An Int8Linear's tensors for every linear layer: int8 weights, int32 sums and fp32
    scales per output, fp32 smoothing per input (its bias is counted as a float tensor)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    per_layer = [(q + 2 * kv, hidden), (hidden, q), (2 * inter, hidden), (hidden, inter)]
    shapes = per_layer * config.num_hidden_layers + [(config.vocab_size, hidden)]
    return sum(out * inp + 2 * FP32 * out + FP32 * inp for out, inp in shapes)


def weight_memory(header: ModelHeader, quantization: str, dtype_size: int) -> WeightMemory:
    """The weights' memory on the path `quantization` takes (see the module docstring)."""
    params = header.parameters
    if quantization == "gguf":
        kept = [t for t in header.tensors if t.is_linear]
        dequantized = (params - sum(t.values for t in kept)) * FP32
        held = sum(t.stored_bytes + t.permuted_copy_bytes for t in kept) + dequantized
        return WeightMemory(held, held + dequantized)
    if quantization == "int8":
        linear = sum(t.values for t in header.tensors if t.is_linear and "embed" not in t.name)
        int8 = _int8_linear_bytes(header.config)
        return WeightMemory(int8 + (params - linear) * FP32, 2 * params * FP32 + int8)
    held = params * dtype_size
    return WeightMemory(held, held + params * FP32)


def buffer_bytes(config: ModelConfig, max_batched_tokens: int, logits_rows: int) -> int:
    """The working buffers, in fp32: the logits of `logits_rows` rows and a same-sized copy
    while sampling; per batched token the residual stream, the normed input, q/k/v, the
    attention output and the MLP's gate/up and activation; the rotary cos/sin tables."""
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    per_token = 3 * config.hidden_size + q + 2 * kv + 3 * config.intermediate_size
    rotaries = 2 if config.local_rope_theta is not None else 1
    tables = rotaries * 2 * config.max_position_embeddings * config.head_dim
    return FP32 * (2 * logits_rows * config.vocab_size + max_batched_tokens * per_token + tables)


@dataclass(frozen=True)
class MemoryEstimate:
    """A model's memory in bytes: its weights, the KV pool and working buffers. The peak
    is the weights while loading (the loader's copies, freed once the model holds its own)
    or, after the load, the weights held + the KV pool + the buffers, whichever is more."""

    weights: WeightMemory
    kv_pool: int
    buffers: int

    @property
    def peak(self) -> int:
        return max(self.weights.loading, self.weights.held + self.kv_pool + self.buffers)

    def describe(self) -> str:
        w = self.weights
        return (
            f"{format_bytes(self.peak)} at its peak: weights {format_bytes(w.held)} "
            f"({format_bytes(w.loading)} while loading), KV pool {format_bytes(self.kv_pool)}, "
            f"buffers {format_bytes(self.buffers)}"
        )


def format_bytes(n: int) -> str:
    """Bytes as GiB (2 decimals) from 1 GiB up, else as MiB or KiB (1 decimal)."""
    if n >= GIB:
        return f"{n / GIB:.2f} GiB"
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def _cgroup_available(root: Path) -> int | None:
    """What the process's cgroup (v2, else v1) still allows: its limit less what it uses,
    its reclaimable page cache not counted as used; None without a limit."""
    for limit_file, usage_file, stat_file, inactive in (
        ("memory.max", "memory.current", "memory.stat", "inactive_file"),
        (
            "memory/memory.limit_in_bytes",
            "memory/memory.usage_in_bytes",
            "memory/memory.stat",
            "total_inactive_file",
        ),
    ):
        try:
            limit = (root / limit_file).read_text().strip()
            usage = int((root / usage_file).read_text())
        except (OSError, ValueError):
            continue
        if limit == "max" or not limit.isdigit() or int(limit) >= 2**60:
            return None
        cache = 0
        try:
            for line in (root / stat_file).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == inactive:
                    cache = int(value)
        except (OSError, ValueError):
            pass
        return max(0, int(limit) - max(0, usage - cache))
    return None


def available_memory(
    meminfo: Path = Path("/proc/meminfo"), cgroup: Path = Path("/sys/fs/cgroup")
) -> int | None:
    """Bytes this process may still take: MemAvailable, or what the cgroup still allows when
    that is less; None when neither can be read (then nothing is refused)."""
    found: list[int] = []
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    group = _cgroup_available(cgroup)
    if group is not None:
        found.append(group)
    return min(found) if found else None


def check_fits(
    estimate: MemoryEstimate,
    available: int | None,
    model: str,
    advice: Callable[[], str],
) -> None:
    """InsufficientMemoryError when `estimate.peak` exceeds `available` bytes: param
    "kv_cache_memory" when the model fits without its KV pool, else "model"; the message
    names the figures, then `advice()` (what to change)."""
    if available is None or estimate.peak <= available:
        return
    w = estimate.weights
    without_pool = max(w.loading, w.held + estimate.buffers)
    param = "kv_cache_memory" if without_pool <= available else "model"
    raise InsufficientMemoryError(
        param,
        f"{model} needs {estimate.describe()}; the machine has {format_bytes(available)} "
        f"available. {advice()}",
    )
