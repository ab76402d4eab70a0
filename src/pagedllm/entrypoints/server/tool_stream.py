"""One choice's text -> content and OpenAI tool-call deltas, in pieces or whole.

`ToolCallStream.feed(text)` returns what the new text completes: content text and tool-call
deltas in OpenAI's streaming shape (`{"index", "id", "type": "function", "function":
{"name", "arguments"}}` opening a call, then `{"index", "function": {"arguments"}}` for
more of its arguments); `feed_in_order` gives the same in the order the model wrote it
(the Responses API makes output items of it). A whole answer runs the same stream over
the whole text and joins the deltas (`whole`), so a stream and a whole answer always
agree.

* auto: the parser's pieces (text held back while a call may be starting; each call sent
  whole when its block closes);
* named: the output is the arguments: the call opens at once and its arguments stream;
* required: the output is a JSON array of `{"name", "parameters"}` objects: each call is
  sent when its object closes (the array's brackets and commas are not content).

Calls past the request's `max_calls` (`parallel_tool_calls: false`: one) are dropped.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from pagedllm.bounded_json import loads
from pagedllm.entrypoints.server.tool_parsers import ParsedCall, ToolParser
from pagedllm.entrypoints.server.tools import ToolUse

Delta = dict[str, Any]


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class Whole:
    """A finished choice: its content and complete calls."""

    content: str | None
    calls: list[Delta]


@dataclass
class ToolCallStream:
    use: ToolUse
    parser_factory: Callable[[Collection[str]], ToolParser]
    calls: int = 0  # calls opened so far
    _parser: ToolParser | None = None
    _scan: _ArrayScanner = field(default_factory=lambda: _ArrayScanner())

    def __post_init__(self) -> None:
        if self.use.mode == "auto":
            self._parser = self.parser_factory(list(self.use.functions))

    def feed(self, text: str) -> tuple[str, list[Delta]]:
        """(content text, tool-call deltas) that `text` completes."""
        return _split(self.feed_in_order(text))

    def finish(self) -> tuple[str, list[Delta]]:
        """What is left when the output ends."""
        return _split(self.finish_in_order())

    def feed_in_order(self, text: str) -> list[str | Delta]:
        """What `text` completes, in the order the model wrote it: content text (str)
        and tool-call deltas."""
        if self._parser is not None:
            return self._pieces(self._parser.feed(text))
        if self.use.mode == "named":
            if not text:
                return []
            if self.calls == 0:
                self.calls = 1
                return [_opening(0, self.use.named or "", text)]
            return [{"index": 0, "function": {"arguments": text}}]
        deltas: list[str | Delta] = []
        for obj in self._scan.feed(text):
            call = _required_call(obj, self.use.functions)
            if call is not None and (delta := self._open(call)):
                deltas.append(delta)
        return deltas

    def finish_in_order(self) -> list[str | Delta]:
        """What is left when the output ends, in order."""
        if self._parser is not None:
            return self._pieces(self._parser.finish())
        return []

    def _pieces(self, pieces: list[Any]) -> list[str | Delta]:
        out: list[str | Delta] = []
        for piece in pieces:
            if piece.call is None:
                out.append(piece.text)
            elif delta := self._open(piece.call):
                out.append(delta)
        return out

    def _open(self, call: ParsedCall) -> Delta | None:
        """The delta that opens `call` whole, or None past the request's `max_calls`."""
        if self.use.max_calls is not None and self.calls >= self.use.max_calls:
            return None
        self.calls += 1
        return _opening(self.calls - 1, call.name, call.arguments)

    def whole(self, text: str) -> Whole:
        """Content and calls of a whole output (this stream is used up)."""
        content, deltas = self.feed(text)
        more, rest = self.finish()
        content += more
        calls: list[Delta] = []
        for d in deltas + rest:
            if d["index"] == len(calls):
                calls.append({k: v for k, v in d.items() if k != "index"})
            else:
                calls[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
        if not calls:
            return Whole(content if self.use.mode == "auto" else content or None, [])
        return Whole(content.strip() or None, calls)


def _split(steps: list[str | Delta]) -> tuple[str, list[Delta]]:
    """(the text, the deltas) of steps in order."""
    text = "".join(s for s in steps if isinstance(s, str))
    return text, [s for s in steps if not isinstance(s, str)]


def _opening(index: int, name: str, arguments: str) -> Delta:
    return {
        "index": index,
        "id": call_id(),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _required_call(text: str, functions: Collection[str]) -> ParsedCall | None:
    try:
        value = loads(text)
    except ValueError:  # not JSON (an unconstrained engine), or nested too deep to be a call
        return None
    name = value.get("name") if isinstance(value, dict) else None
    if name not in functions or not isinstance(value.get("parameters"), dict):
        return None
    return ParsedCall(name, json.dumps(value["parameters"], ensure_ascii=False))


class _ArrayScanner:
    """The text of each complete top-level element object of a JSON array, as it closes."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.current: list[str] = []

    def feed(self, text: str) -> list[str]:
        done = []
        for ch in text:
            if self.depth >= 2 or (self.depth == 1 and ch == "{"):
                self.current.append(ch)
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "[{":
                self.depth += 1
            elif ch in "]}":
                self.depth -= 1
                if self.depth == 1 and self.current:
                    done.append("".join(self.current))
                    self.current = []
        return done
