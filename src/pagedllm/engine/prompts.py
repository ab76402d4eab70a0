"""Prompt token ids from what users send: text, token ids, or a chat conversation.

The offline API and the server share these rules: text must be valid Unicode (a lone
surrogate cannot be tokenised), token ids must lie in the vocabulary, and conversations
go through the model's chat template. Errors name the parameter they came from.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from typing import Any

from pagedllm.engine.chat_tools import render_for_template
from pagedllm.errors import InvalidParameterError


def check_text(text: str, param: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidParameterError(
            param,
            f"{param} is not valid Unicode text: a lone surrogate at character {exc.start}",
        ) from None


def encode_text(tokenizer: Any, text: str, param: str = "prompt") -> list[int]:
    if tokenizer is None:
        raise InvalidParameterError(param, "this model has no tokenizer: pass prompt token ids")
    check_text(text, param)
    return list(tokenizer.encode(text, add_special_tokens=True))


def encode_chat(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    param: str = "messages",
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[int]:
    """Token ids of a conversation ([{"role": ..., "content": ...}, ...]) under the
    model's chat template, with the `tools` offered (OpenAI's function tools), if any:
    in the template's own way, or in the Hermes format where it has none
    (engine/chat_tools.py)."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise InvalidParameterError(
            param,
            "this model has no chat template (a base model, not an instruction-tuned one), so "
            "it cannot take chat messages; send the text as a plain prompt instead",
        )
    for i, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, str):
            check_text(content, f"{param}[{i}].content")
    rendered, template_tools = render_for_template(tokenizer, messages, tools)
    try:
        text = tokenizer.apply_chat_template(
            rendered,
            tools=template_tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )
    except Exception as exc:  # the template is user-visible Jinja: any error is the input's
        raise InvalidParameterError(param, f"cannot apply the chat template: {exc}") from None
    return list(tokenizer.encode(text, add_special_tokens=False))


def check_token_ids(ids: Sequence[int], vocab_size: int, param: str = "prompt") -> list[int]:
    out = []
    for t in ids:
        try:
            token = operator.index(t)  # ints, numpy ints; not floats or strings
        except TypeError:
            token = -1
        if isinstance(t, bool) or not 0 <= token < vocab_size:
            raise InvalidParameterError(
                param, f"{param} token ids must be integers in [0, {vocab_size - 1}], got {t!r}"
            )
        out.append(token)
    if not out:
        raise InvalidParameterError(param, f"{param} must contain at least one token")
    return out
