"""Reading a GGUF file's header: its key/values and where each tensor's bytes lie.

A plain parser over a copy-on-write memory map (the file is never written; tensors viewing
it can be handed to torch). `gguf.GGUFReader` builds numpy views for every
item of every array (three per token of a 262k-token vocabulary: ~10 s); this one decodes
numeric arrays in one `frombuffer` and skips long string arrays unless asked for them
(0.1 s), then hands each tensor's bytes to `gguf.quants` as the reader would.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np

from pagedllm.errors import ModelLoadError

# GGUF value type -> (struct format, numpy dtype) of the fixed-size ones (8: string, 9: array).
_SCALARS = {
    0: ("<B", np.uint8),
    1: ("<b", np.int8),
    2: ("<H", np.uint16),
    3: ("<h", np.int16),
    4: ("<I", np.uint32),
    5: ("<i", np.int32),
    6: ("<f", np.float32),
    7: ("<?", np.bool_),
    10: ("<Q", np.uint64),
    11: ("<q", np.int64),
    12: ("<d", np.float64),
}
_STRING, _ARRAY = 8, 9
# String arrays longer than this (vocabularies, merges) are kept as their length only.
MAX_KEPT_STRINGS = 4096
DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class SkippedArray:
    """A long string array left unread: only its length is known."""

    length: int


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: its GGUF name, dims innermost first (as GGUF lists them), type and bytes
    shaped [..outer dims, bytes per row] for `gguf.quants.dequantize`."""

    name: str
    shape: tuple[int, ...]
    tensor_type: gguf.GGMLQuantizationType
    data: np.ndarray


class _Cursor:
    def __init__(self, blob: np.ndarray) -> None:
        self.blob, self.buf, self.pos = blob, memoryview(blob), 0

    def unpack(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        self.pos += n
        return bytes(self.buf[self.pos - n : self.pos]).decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind][0])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise ValueError(f"unknown metadata value type {kind}")
        item, count = self.unpack("<I"), self.unpack("<Q")
        if item in _SCALARS:
            dtype = np.dtype(_SCALARS[item][1]).newbyteorder("<")
            array = np.frombuffer(self.blob, dtype, count, self.pos)
            self.pos += count * dtype.itemsize
            return array.tolist() if count <= MAX_KEPT_STRINGS else array
        if item == _STRING and count > MAX_KEPT_STRINGS:
            for _ in range(count):  # only the lengths are read
                self.pos += 8 + struct.unpack_from("<Q", self.buf, self.pos)[0]
            return SkippedArray(count)
        return [self.value(item) for _ in range(count)]


def _tensor_bytes(kind: gguf.GGMLQuantizationType, dims: tuple[int, ...]) -> tuple[int, ...]:
    """The byte shape of a tensor: outer dims (outermost first), then bytes per row."""
    block, size = gguf.GGML_QUANT_SIZES[kind]
    if dims[0] % block:
        raise ValueError(f"row of {dims[0]} values is not a whole number of {block}-blocks")
    return (*reversed(dims[1:]), dims[0] // block * size)


def read_gguf(path: str) -> tuple[dict[str, Any], list[GGUFTensor]]:
    """The metadata and tensors of the GGUF file at `path` (ModelLoadError if unreadable)."""
    try:
        blob = np.memmap(path, dtype=np.uint8, mode="c").view(np.ndarray)
        cur = _Cursor(blob)
        if bytes(blob[:4]) != b"GGUF":
            raise ValueError("no GGUF magic number")
        cur.pos = 4
        version = cur.unpack("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (supported: 2, 3)")
        n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            metadata[key] = cur.value(cur.unpack("<I"))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = tuple(cur.unpack("<Q") for _ in range(cur.unpack("<I")))
            infos.append(
                (name, dims, gguf.GGMLQuantizationType(cur.unpack("<I")), cur.unpack("<Q"))
            )
        align = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        start = -(-cur.pos // align) * align
        tensors = []
        for name, dims, kind, offset in infos:
            shape = _tensor_bytes(kind, dims)
            count = int(np.prod(shape))
            data = blob[start + offset : start + offset + count]
            if data.size != count:
                raise ValueError(f"tensor {name!r} runs past the end of the file")
            tensors.append(GGUFTensor(name, dims, kind, data.reshape(shape)))
    except (ValueError, struct.error, OSError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path}: not a readable GGUF file: {exc}") from exc
    return metadata, tensors


def as_float(value: Any) -> float:
    """A float32 metadata value as the decimal it was written from (9.99e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


class GGUFMetadata:
    """Typed access to a GGUF's key/value metadata."""

    def __init__(self, values: dict[str, Any], path: str) -> None:
        self.values = values
        self.path = path

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ModelLoadError(f"{self.path}: GGUF metadata has no {key!r}")
        return value

    def array_len(self, key: str) -> int | None:
        value = self.values.get(key)
        if isinstance(value, SkippedArray):
            return value.length
        return None if value is None else len(value)
