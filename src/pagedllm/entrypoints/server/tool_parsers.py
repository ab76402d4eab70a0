"""Tool-call parsers for `tool_choice: "auto"`: the model's own call format -> tool calls.

With "auto" the model chooses between text and calls, in the format it was trained on, so
the server reads that format back out of its text. Parsers are chosen by name, as vLLM's
`--tool-call-parser` (`pagedllm serve --tool-call-parser hermes`); `PARSERS` is the
registry. `hermes` reads `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, the
format of Hermes and Qwen2/2.5/3 and what the server's fallback tool prompt asks for
(chat_template.py), and a JSON list of such calls in one block (a variant some
models write).

A parser sees a choice's text in pieces (`feed`, then `finish`) and returns `Piece`s in
order: plain text, or a complete call. Text outside the calls stays content. A call block
whose JSON does not parse, is not `{"name": str, "arguments": object}`, or names a
function the request did not offer stays text, as does a block the output never closed
or JSON nested deeper than bounded_json allows:
the client sees what the model wrote rather than an error. The whole-response path runs
the same parser over the whole text, so a stream and a whole answer agree.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from pagedllm.bounded_json import loads

# The Hermes call tags: written by the fallback tool prompt, read by the hermes parser.
CALL_START, CALL_END = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object, as OpenAI sends it


@dataclass(frozen=True)
class Piece:
    """Plain text (`call` None) or one complete call (`text` empty)."""

    text: str = ""
    call: ParsedCall | None = None


class ToolParser(ABC):
    """One choice's parser: fed its text in order, once."""

    def __init__(self, functions: Collection[str]) -> None:
        self.functions = functions

    @abstractmethod
    def feed(self, text: str) -> list[Piece]:
        """The pieces `text` completes (text that may start a call is held back)."""

    @abstractmethod
    def finish(self) -> list[Piece]:
        """The pieces left at the end of the output."""


class HermesToolParser(ToolParser):
    START, END = CALL_START, CALL_END

    def __init__(self, functions: Collection[str]) -> None:
        super().__init__(functions)
        self._buffer = ""
        self._in_call = False

    def feed(self, text: str) -> list[Piece]:
        self._buffer += text
        pieces: list[Piece] = []
        while True:
            if self._in_call:
                end = self._buffer.find(self.END)
                if end < 0:
                    return pieces
                block = self._buffer[: end + len(self.END)]
                self._buffer = self._buffer[end + len(self.END) :]
                self._in_call = False
                pieces += self._block(block)
                continue
            start = self._buffer.find(self.START)
            if start < 0:
                keep = partial_suffix(self._buffer, self.START)
                cut = len(self._buffer) - keep
                if cut:
                    pieces.append(Piece(self._buffer[:cut]))
                self._buffer = self._buffer[cut:]
                return pieces
            if start:
                pieces.append(Piece(self._buffer[:start]))
            self._buffer = self._buffer[start:]
            self._in_call = True

    def finish(self) -> list[Piece]:
        rest, self._buffer, self._in_call = self._buffer, "", False
        return [Piece(rest)] if rest else []

    def _block(self, block: str) -> list[Piece]:
        calls = self._calls(block[len(self.START) : -len(self.END)])
        return [Piece(call=c) for c in calls] if calls else [Piece(block)]

    def _calls(self, body: str) -> list[ParsedCall]:
        """The block's calls: one object, or a list of them; none
        unless every one is a call of an offered function."""
        try:
            value = loads(body)
        except ValueError:  # not JSON, or nested too deep to be a call
            return []
        values = value if isinstance(value, list) else [value]
        calls = [self._call(v) for v in values]
        return [c for c in calls if c is not None] if None not in calls else []

    def _call(self, value: Any) -> ParsedCall | None:
        if not isinstance(value, dict) or value.get("name") not in self.functions:
            return None
        # "parameters" is the older spelling some models were trained on
        args: Any = value.get("arguments", value.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        return ParsedCall(value["name"], json.dumps(args, ensure_ascii=False))


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


PARSERS: dict[str, Callable[[Collection[str]], ToolParser]] = {"hermes": HermesToolParser}
DEFAULT_PARSER = "hermes"  # the format of every chat model this project runs


def parser_factory(name: str) -> Callable[[Collection[str]], ToolParser]:
    """The parser registered as `name`; ValueError listing the names otherwise."""
    if name not in PARSERS:
        raise ValueError(
            f"unknown tool-call parser {name!r}; choose one of: {', '.join(sorted(PARSERS))}"
        )
    return PARSERS[name]
