"""Load a llama.cpp GGUF file: config from its metadata, dequantized weights, its tokenizer.

Every tensor type `gguf.quants` dequantizes loads (F32, F16, BF16, Q4_0/1, Q5_0/1, Q8_0, the
K-quants Q2_K..Q6_K, ...), to float32. Families: see gguf_config.GGUF_ARCHITECTURES; names
and the converter's rewrites (Q/K permutation, Gemma's 1 + w norms, Phi-3's fused tensors)
are undone by gguf_tensors, so the weights equal the original checkpoint's.

With `keep_quantized` (`quantization="gguf"`), the linear layers' weights and the embedding
table are not dequantized: each stays a `GGUFWeight`, a uint8 view of its blocks in the
memory map. Of the converter's changes, only the Q/K row permutation touches them: whole
rows of blocks are permuted back, one tensor at a time (a copy of that tensor, whose pages
in the map are then handed back: they would otherwise count in resident memory beside the
copy, 0.11 GB on a 1.7B-shaped file); fused tensors split into row ranges of the map.
"""

from __future__ import annotations

import ctypes
import mmap
import os

import gguf
import numpy as np
import torch

from pagedllm.errors import InvalidParameterError, ModelLoadError
from pagedllm.loader.gguf_config import GGUF_ARCHITECTURES, gguf_config
from pagedllm.loader.gguf_metadata import GGUFMetadata, GGUFTensor, read_gguf
from pagedllm.loader.gguf_tensors import hf_name, hf_tensors, unpermute_rows
from pagedllm.loader.loaded import LoadedModel, check_weights
from pagedllm.loader.tokenizer import load_gguf_tokenizer
from pagedllm.model.gguf_linear import STORED_TYPES, GGUFWeight

__all__ = ["GGUF_ARCHITECTURES", "hf_name", "load_gguf", "unpermute_rows"]

# Tensors of long-context rope variants the decoder does not compute.
UNSUPPORTED_TENSORS = {
    "rope_freqs.weight": "per-dimension rope frequency factors (llama3-style rope scaling)",
    "rope_factors_long.weight": "Phi-3's long-context rope (longrope)",
    "rope_factors_short.weight": "Phi-3's long-context rope (longrope)",
}


def _dequantize(tensor: GGUFTensor, path: str) -> np.ndarray:
    """One GGUF tensor as a float32 array in numpy (= torch) dimension order."""
    try:
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        kind = getattr(tensor.tensor_type, "name", tensor.tensor_type)
        raise ModelLoadError(f"{path}: tensor {tensor.name!r} has unsupported type {kind}") from exc
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims innermost first
    array = array.reshape(shape)
    if array.dtype != np.float32 or np.may_share_memory(array, tensor.data):
        array = array.astype(np.float32)  # copy off the read-only memory map
    return array


def kept_as_blocks(name: str) -> bool:
    """Whether the weight `name` (Hugging Face) is a linear layer's or the embedding table."""
    return name.endswith(("_proj.weight", "lm_head.weight", "embed_tokens.weight"))


def _blocks(tensor: GGUFTensor, path: str) -> np.ndarray:
    """One GGUF tensor's raw bytes [out, bytes per row], refused unless a kernel takes it."""
    if tensor.tensor_type not in STORED_TYPES or len(tensor.shape) != 2:
        kind = getattr(tensor.tensor_type, "name", tensor.tensor_type)
        names = ", ".join(t.name for t in STORED_TYPES)
        raise InvalidParameterError(
            "quantization",
            f"quantization='gguf' computes on {names} weights; {path}: tensor "
            f"{tensor.name!r} is {kind} (use quantization none or int8 for this file)",
        )
    return tensor.data


_LIBC = ctypes.CDLL(None, use_errno=True)


def release_pages(array: np.ndarray) -> None:
    """Drop the pages wholly inside `array`, a part of the file's private memory map that
    is never written, from the process: they stop counting in its resident memory, and
    would be read from the file again if touched (nothing touches them: a copy replaced
    them)."""
    page = mmap.PAGESIZE
    start = array.ctypes.data
    begin, end = -(-start // page) * page, (start + array.nbytes) // page * page
    if end > begin:
        _LIBC.madvise(ctypes.c_void_p(begin), ctypes.c_size_t(end - begin), mmap.MADV_DONTNEED)


def load_gguf(path: str, keep_quantized: bool = False) -> LoadedModel:
    """Load a GGUF file (see the module docstring)."""
    path = os.path.abspath(path)
    values, tensors = read_gguf(path)
    meta = GGUFMetadata(values, path)
    tensor_shapes = {t.name: t.shape for t in tensors}
    config = gguf_config(meta, tensor_shapes)
    for name, what in UNSUPPORTED_TENSORS.items():
        if name in tensor_shapes:
            raise ModelLoadError(
                f"{path}: {what} ({name}) is not supported in GGUF files; "
                "load the Hugging Face checkpoint"
            )
    weights: dict[str, torch.Tensor | GGUFWeight] = {}
    for tensor in tensors:
        name = hf_name(tensor.name, config.sandwich_norms)
        if name is None:
            raise ModelLoadError(f"{path}: unexpected tensor {tensor.name!r}")
        if keep_quantized and kept_as_blocks(name):
            width, blocks = int(tensor.shape[0]), _blocks(tensor, path)
            parts = list(hf_tensors(name, blocks, config))
            for hf, rows in parts:
                weights[hf] = GGUFWeight(torch.from_numpy(rows), tensor.tensor_type, width)
            if not any(np.may_share_memory(rows, blocks) for _, rows in parts):
                release_pages(blocks)  # the Q/K permutation copied it
            continue
        for hf, array in hf_tensors(name, _dequantize(tensor, path), config):
            weights[hf] = torch.from_numpy(array)
    check_weights(config, weights, path)
    tokenizer = None
    if meta.array_len("tokenizer.ggml.tokens"):
        tokenizer = load_gguf_tokenizer(path, meta.get("tokenizer.chat_template"))
    folder, file_name = os.path.split(path)
    return LoadedModel(
        config=config,
        weights=weights,
        tokenizer=tokenizer,
        source=path,
        hf_dir=folder,
        gguf_file=file_name,
        kept_quantized=keep_quantized,
    )
