"""EngineConfig: every engine option in one frozen, validated dataclass.

Sizes of the KV pool may be given in blocks (`num_kv_blocks`) or in bytes
(`kv_cache_memory`, an int or a string such as "256MiB").
"""

from __future__ import annotations

import re
from dataclasses import dataclass

KV_RESERVATIONS = ("paged", "reserve-max", "reserve-pow2", "reserve-oracle")
DTYPES = ("float32", "bfloat16", "float16")
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
}


def parse_size(value: int | str) -> int:
    """Bytes from an int or a string like "256MiB", "1.5GB", "1048576"."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(value))
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(
            f"kv_cache_memory must be a byte count like '256MiB' or '2GB', got {value!r}"
        )
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # None: the default SmolLM2-135M-Instruct GGUF
    block_size: int = 16
    kv_cache_memory: int | str = "1GiB"
    num_kv_blocks: int | None = None  # overrides kv_cache_memory when set
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's context, capped by the pool
    dtype: str = "float32"
    device: str = "cpu"
    enable_prefix_caching: bool = True
    kv_reservation: str = "paged"
    watermark: float = 0.01  # fraction of blocks kept free when admitting new requests
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.block_size <= 256:
            raise ValueError(f"block_size must be in [1, 256], got {self.block_size}")
        if parse_size(self.kv_cache_memory) <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.kv_reservation not in KV_RESERVATIONS:
            raise ValueError(
                f"kv_reservation must be one of {', '.join(KV_RESERVATIONS)}, "
                f"got {self.kv_reservation!r}"
            )
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
