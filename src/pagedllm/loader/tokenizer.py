"""Tokenizers for the loaders: from a GGUF's metadata, or from a Hugging Face directory.

Both return a transformers tokenizer. The GGUF one is built straight from the file (the
`AutoTokenizer` route parses the whole GGUF a second time to pick a class: seconds slower),
and saved under the cache folder (cache_root.py), keyed by the file's path, size and
modification time, since building it takes seconds.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from pagedllm.cache_root import cache_root
from pagedllm.errors import ModelLoadError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger("pagedllm")

# Any of these in a directory means it carries a tokenizer.
HF_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
)


def load_gguf_tokenizer(path: str, chat_template: str | None) -> PreTrainedTokenizerBase:
    """The tokenizer stored in the GGUF at `path`, with the file's chat template set."""
    from transformers import PreTrainedTokenizerFast

    saved = saved_tokenizer_dir(path)
    tokenizer = None
    if saved.is_dir():
        try:
            tokenizer = PreTrainedTokenizerFast.from_pretrained(str(saved))
        except Exception as exc:  # a damaged cache entry: build the tokenizer again
            logger.warning("could not load the saved tokenizer %s (%s): rebuilding it", saved, exc)
            shutil.rmtree(saved, ignore_errors=True)
    if tokenizer is None:
        tokenizer = _build_gguf_tokenizer(path)
        _save(tokenizer, saved)
    if chat_template and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = chat_template
    return tokenizer


def saved_tokenizer_dir(path: str) -> Path:
    """Where the tokenizer built from the GGUF at `path` is saved."""
    import transformers

    real = os.path.realpath(path)
    stat = os.stat(real)
    key = f"{real}\0{stat.st_size}\0{stat.st_mtime_ns}\0{transformers.__version__}"
    return cache_root() / "tokenizers" / hashlib.sha256(key.encode()).hexdigest()[:24]


def _build_gguf_tokenizer(path: str) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    folder, name = os.path.split(os.path.abspath(path))
    try:
        return PreTrainedTokenizerFast.from_pretrained(folder, gguf_file=name)
    except Exception:
        try:  # the generic route picks a model-specific class; slower but more general
            return AutoTokenizer.from_pretrained(folder, gguf_file=name)
        except Exception as exc:
            raise ModelLoadError(f"{path}: could not build the tokenizer: {exc}") from exc


def _save(tokenizer: PreTrainedTokenizerBase, folder: Path) -> None:
    """Save `tokenizer` to `folder` whole or not at all (another process may be saving or
    reading it too); a cache that cannot be written only costs the next load time."""
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = tempfile.mkdtemp(dir=folder.parent, prefix=folder.name + ".tmp")
        tokenizer.save_pretrained(staging)
        try:
            os.rename(staging, folder)
        except OSError:  # saved meanwhile by another process
            shutil.rmtree(staging, ignore_errors=True)
    except OSError as exc:
        logger.warning("could not save the tokenizer under %s: %s", folder.parent, exc)


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
