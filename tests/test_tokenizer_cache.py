"""The tokenizer built from a GGUF file is saved under the cache folder and loaded from
there next time (seconds saved per load): the saved one tokenizes, decodes and renders the
chat template exactly as a freshly built one; a changed file gets a new entry; a damaged
entry is rebuilt."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from pagedllm.loader import tokenizer as tokenizers
from pagedllm.loader.packaged_models import resolve_model_path

TEXT = "Hello world!  <|im_start|> ünïcode 日本\n\n  x"
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is the capital of France?"},
]


@pytest.fixture
def model_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of the default model's GGUF, with an empty cache folder of its own."""
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "model.gguf"
    shutil.copyfile(resolve_model_path(None), path)
    return path


def _refuse_to_build(path: str) -> None:
    raise AssertionError("the tokenizer was built again instead of loaded")


def test_saved_tokenizer_is_the_built_one(model_file: Path, monkeypatch) -> None:
    built = tokenizers.load_gguf_tokenizer(str(model_file), None)
    saved = tokenizers.saved_tokenizer_dir(str(model_file))
    assert (saved / "tokenizer.json").is_file()
    monkeypatch.setattr(tokenizers, "_build_gguf_tokenizer", _refuse_to_build)
    loaded = tokenizers.load_gguf_tokenizer(str(model_file), None)
    assert loaded.encode(TEXT) == built.encode(TEXT)
    ids = built.encode(TEXT)
    assert loaded.decode(ids) == built.decode(ids)
    assert loaded.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == (
        built.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    )
    assert (loaded.eos_token_id, loaded.bos_token_id, len(loaded)) == (
        built.eos_token_id,
        built.bos_token_id,
        len(built),
    )
    assert [p.name for p in saved.parent.iterdir()] == [saved.name]  # no staging left


def test_a_changed_file_gets_a_new_entry(model_file: Path) -> None:
    tokenizers.load_gguf_tokenizer(str(model_file), None)
    before = tokenizers.saved_tokenizer_dir(str(model_file))
    stat = os.stat(model_file)
    os.utime(model_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    after = tokenizers.saved_tokenizer_dir(str(model_file))
    assert after != before and not after.exists()


def test_a_damaged_entry_is_rebuilt(model_file: Path, monkeypatch) -> None:
    saved = tokenizers.saved_tokenizer_dir(str(model_file))
    saved.mkdir(parents=True)
    (saved / "tokenizer.json").write_text("{not json")
    tokenizer = tokenizers.load_gguf_tokenizer(str(model_file), None)
    assert tokenizer.decode(tokenizer.encode("The capital of France")) == "The capital of France"
    monkeypatch.setattr(tokenizers, "_build_gguf_tokenizer", _refuse_to_build)
    tokenizers.load_gguf_tokenizer(str(model_file), None)  # the entry was saved anew
