"""Reasoning parsers: a thinking model's output -> (reasoning, answer), as vLLM's
`--reasoning-parser`.

Thinking models write their reasoning between `<think>` and `</think>`, then the answer.
The parsers differ in where the output starts:

* `deepseek_r1`: in reasoning. Everything before the first `</think>` is reasoning (a
  `<think>` there is dropped), since R1 distills' chat templates open the block in the
  prompt and the output holds only its end; no `</think>` at all: all reasoning.
* `qwen3`: in the answer. Only a `<think>` opens reasoning; text before it is answer,
  and a block never closed holds the rest of the output.

After the `</think>` that ends the reasoning everything is answer, tags included. The
tags that open and end the reasoning are in neither part. `split` takes a whole output;
`ReasoningStream` takes it in pieces and holds back text that may be the start of a tag,
so that its pieces joined equal `split` of the whole (a part that is empty is None
there). `think_tokens` gives the tags' token ids, with which the engine starts a grammar
after the reasoning, and `reasoning_tokens` counts an output's reasoning by them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagedllm.entrypoints.server.tool_parsers import partial_suffix
from pagedllm.sampling_params import ThinkTokens

THINK_START, THINK_END = "<think>", "</think>"

# The states of an output: reasoning where a `<think>` may still come (and is dropped),
# answer before any `<think>`, reasoning inside a block, and answer after it.
_OPENING, _BEFORE, _REASONING, _ANSWER = "opening", "before", "reasoning", "answer"


@dataclass(frozen=True)
class ReasoningParser:
    """One parser: its name and the state its output starts in."""

    name: str
    starts_in_reasoning: bool

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, answer) of a whole output; an empty part is None."""
        stream = self.stream()
        reasoning, answer = stream.feed(text)
        more_reasoning, more_answer = stream.finish()
        return (reasoning + more_reasoning) or None, (answer + more_answer) or None

    def stream(self) -> ReasoningStream:
        return ReasoningStream(_OPENING if self.starts_in_reasoning else _BEFORE)

    def think_tokens(self, tokenizer: Any) -> ThinkTokens | None:
        """The tags' token ids in `tokenizer` (the engine's grammar starts after the end
        tag), or None when the vocabulary lacks either as one token."""
        vocab = tokenizer.get_vocab() if tokenizer is not None else {}
        start, end = vocab.get(THINK_START), vocab.get(THINK_END)
        if start is None or end is None:
            return None
        return ThinkTokens(end=end, start=None if self.starts_in_reasoning else start)


class ReasoningStream:
    """One output fed in pieces: each piece -> (reasoning text, answer text) it completes."""

    def __init__(self, state: str) -> None:
        self._state = state
        self._held = ""  # the end of the text so far that may start a tag

    def feed(self, text: str) -> tuple[str, str]:
        reasoning, answer = [], []
        text = self._held + text
        self._held = ""
        while text:
            if self._state == _ANSWER:
                answer.append(text)
                break
            tags = _WATCHED[self._state]
            found = [(i, tag) for tag in tags if (i := text.find(tag)) >= 0]
            out = answer if self._state == _BEFORE else reasoning
            if not found:
                keep = max(partial_suffix(text, tag) for tag in tags)
                out.append(text[: len(text) - keep])
                self._held = text[len(text) - keep :]
                break
            at, tag = min(found)
            out.append(text[:at])
            text = text[at + len(tag) :]
            self._state = _ANSWER if tag == THINK_END else _REASONING
        return "".join(reasoning), "".join(answer)

    def finish(self) -> tuple[str, str]:
        """What was held back, when the output ends: text of the part it was in."""
        held, self._held = self._held, ""
        return (held, "") if self._state in (_OPENING, _REASONING) else ("", held)


def reasoning_tokens(token_ids: Sequence[int], think: ThinkTokens) -> int:
    """How many of an output's tokens are its reasoning, tags included: from where the
    reasoning opens (the output's start, or with `think.start` set, as for a parser whose
    output starts in the answer, its first think-start token) up to and including the
    first think-end token after that, or to the output's end when the block never ends."""
    ids = list(token_ids)
    first = 0
    if think.start is not None:
        if think.start not in ids:
            return 0
        first = ids.index(think.start)
    last = ids.index(think.end, first) + 1 if think.end in ids[first:] else len(ids)
    return last - first


# The tags each state looks for: `</think>` ends reasoning, `<think>` opens it.
_WATCHED = {
    _OPENING: (THINK_START, THINK_END),
    _BEFORE: (THINK_START,),
    _REASONING: (THINK_END,),
}


REASONING_PARSERS: dict[str, ReasoningParser] = {
    "deepseek_r1": ReasoningParser("deepseek_r1", starts_in_reasoning=True),
    "qwen3": ReasoningParser("qwen3", starts_in_reasoning=False),
}


def reasoning_parser(name: str | None) -> ReasoningParser | None:
    """The parser registered as `name` (None: none); ValueError listing the names."""
    if name is None:
        return None
    if name not in REASONING_PARSERS:
        raise ValueError(
            f"unknown reasoning parser {name!r}; choose one of: "
            + ", ".join(sorted(REASONING_PARSERS))
        )
    return REASONING_PARSERS[name]
