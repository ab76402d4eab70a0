"""Tokenizers for the loaders: from a GGUF's metadata, or from a Hugging Face directory.

Both return a transformers tokenizer. The GGUF one is built straight from the file (the
`AutoTokenizer` route parses the whole GGUF a second time to pick a class: seconds slower).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from pagedllm.errors import ModelLoadError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Any of these in a directory means it carries a tokenizer.
HF_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
)


def load_gguf_tokenizer(path: str, chat_template: str | None) -> PreTrainedTokenizerBase:
    """The tokenizer stored in the GGUF at `path`, with the file's chat template set."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    folder, name = os.path.split(os.path.abspath(path))
    try:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(folder, gguf_file=name)
    except Exception:
        try:  # the generic route picks a model-specific class; slower but more general
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        except Exception as exc:
            raise ModelLoadError(f"{path}: could not build the tokenizer: {exc}") from exc
    if chat_template and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = chat_template
    return tokenizer


def load_hf_tokenizer(folder: str) -> PreTrainedTokenizerBase | None:
    """The tokenizer saved in a Hugging Face directory, or None if it has no tokenizer files."""
    if not any(os.path.isfile(os.path.join(folder, f)) for f in HF_TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder)
    except Exception as exc:
        raise ModelLoadError(f"{folder}: could not load the tokenizer: {exc}") from exc


def load_tokenizer(path: str | None = None) -> PreTrainedTokenizerBase | None:
    """The tokenizer of a model (a .gguf file, a Hugging Face directory or a packaged
    model's name; None: the default model) without loading its weights."""
    from pagedllm.loader.packaged_models import resolve_model_path

    path = resolve_model_path(path)
    if os.path.isdir(path):
        return load_hf_tokenizer(path)
    return load_gguf_tokenizer(path, None)
