"""Prompt token ids from what users send: text or token ids.

The offline API and the server share these rules: text must be valid Unicode (a lone
surrogate cannot be tokenised) and token ids must lie in the vocabulary. Errors name the
parameter they came from. Chat conversations go through the model's chat template first
(entrypoints/server/chat_template.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagedllm.errors import InvalidParameterError
from pagedllm.validation import check_int


def check_text(text: str, param: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidParameterError(
            param,
            f"{param} is not valid Unicode text: a lone surrogate at character {exc.start}",
        ) from None


def encode_text(
    tokenizer: Any, text: str, param: str = "prompt", add_special_tokens: bool = True
) -> list[int]:
    if tokenizer is None:
        raise InvalidParameterError(param, "this model has no tokenizer: pass prompt token ids")
    check_text(text, param)
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def check_token_ids(ids: Sequence[int], vocab_size: int, param: str = "prompt") -> list[int]:
    subject = f"{param} token id"
    out = [check_int(t, param, min=0, max=vocab_size - 1, subject=subject) for t in ids]
    if not out:
        raise InvalidParameterError(param, f"{param} must contain at least one token")
    return out
