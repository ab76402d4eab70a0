"""Incremental detokenisation: the text a sequence gained with its newest tokens.

Decoding a short window before the new tokens keeps word-initial spaces right for
SentencePiece-style tokenizers; text is held back while it ends in an incomplete UTF-8
character (decoded as U+FFFD). The window's offsets live in a `DetokenizerState` the
output processor keeps per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedllm.core.sequence import Sequence

_WINDOW = 5


@dataclass
class DetokenizerState:
    prefix_offset: int
    read_offset: int

    @classmethod
    def start(cls, seq: Sequence) -> DetokenizerState:
        n = seq.num_prompt_tokens
        return cls(prefix_offset=max(n - _WINDOW, 0), read_offset=n)


def detokenize_incrementally(
    tokenizer: Any, seq: Sequence, state: DetokenizerState, skip_special_tokens: bool
) -> str:
    """Append the newly decodable text to `seq.output_text` and return it."""
    ids = seq.token_ids
    prefix = tokenizer.decode(
        ids[state.prefix_offset : state.read_offset], skip_special_tokens=skip_special_tokens
    )
    full = tokenizer.decode(ids[state.prefix_offset :], skip_special_tokens=skip_special_tokens)
    if len(full) <= len(prefix) or full.endswith("\ufffd"):
        return ""
    delta = full[len(prefix) :]
    state.prefix_offset = state.read_offset
    state.read_offset = len(ids)
    seq.output_text += delta
    return delta
