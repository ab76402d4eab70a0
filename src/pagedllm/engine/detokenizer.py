"""Incremental detokenisation: the text a sequence gained with its newest tokens.

Decoding a short window before the new tokens keeps word-initial spaces right for
SentencePiece-style tokenizers; text is held back while it ends in an incomplete UTF-8
character (decoded as U+FFFD).
"""

from __future__ import annotations

from typing import Any

from pagedllm.core.sequence import Sequence

_WINDOW = 5


def start_offsets(seq: Sequence) -> None:
    seq.read_offset = seq.num_prompt_tokens
    seq.prefix_offset = max(seq.num_prompt_tokens - _WINDOW, 0)


def detokenize_incrementally(tokenizer: Any, seq: Sequence, skip_special_tokens: bool) -> str:
    """Append the newly decodable text to `seq.output_text` and return it."""
    ids = seq.token_ids
    prefix = tokenizer.decode(
        ids[seq.prefix_offset : seq.read_offset], skip_special_tokens=skip_special_tokens
    )
    full = tokenizer.decode(ids[seq.prefix_offset :], skip_special_tokens=skip_special_tokens)
    if len(full) <= len(prefix) or full.endswith("\ufffd"):
        return ""
    delta = full[len(prefix) :]
    seq.prefix_offset = seq.read_offset
    seq.read_offset = len(ids)
    seq.output_text += delta
    return delta
