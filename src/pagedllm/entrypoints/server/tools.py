"""Tool calling by grammar: chat's `tools` with `tool_choice` "required" or a named function.

The output is constrained to the call's JSON, so it parses whatever the model: a named
function's output is its arguments (the function's parameter schema); "required" gives a
JSON array of one or more `{"name", "parameters"}` calls, each one of the tools (vLLM's
shape). The answer carries `message.tool_calls` (ids `call_` + 24 hex digits) and
`finish_reason: "tool_calls"`. "none" ignores the tools. "auto" (and no tool_choice, which
means "auto") is refused: choosing between text and a call needs the model's own
tool-call format and parser, which this server does not have yet.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from pagedllm.errors import UNSUPPORTED, InvalidParameterError

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolCalls:
    """How a request's output becomes tool calls: `named` is the forced function, or None
    for "required" (an array of calls)."""

    schema: dict[str, Any]
    named: str | None
    field: str  # the request's field the schema comes from, for errors

    def calls(self, text: str) -> list[dict[str, Any]] | None:
        """The tool calls of a finished output; None if it does not parse (it was cut
        short by max_tokens)."""
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if self.named is not None:
            pairs = [(self.named, value)]
        else:
            pairs = [(call["name"], call["parameters"]) for call in value]
        return [
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)},
            }
            for name, args in pairs
        ]


def tool_calls(tools: Any, tool_choice: Any) -> ToolCalls | None:
    """The tool calls the request forces, or None (no tools, or tool_choice "none");
    InvalidParameterError names the field that is wrong or unsupported."""
    if tool_choice == "none" or (not tools and tool_choice is None):
        return None
    if not tools:
        raise InvalidParameterError("tool_choice", "tool_choice needs tools")
    functions = _functions(tools)
    if tool_choice in (None, "auto"):
        raise InvalidParameterError(
            "tool_choice",
            'tool_choice "auto" (the default with tools) is not supported by this server: '
            'use "required", a named function, or "none"',
            UNSUPPORTED,
        )
    if tool_choice == "required":
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": params},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, params in functions.items()
        ]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        return ToolCalls(schema, None, "tools")
    name = _named(tool_choice)
    if name not in functions:
        raise InvalidParameterError(
            "tool_choice.function.name",
            f"tool_choice.function.name {name!r} is not one of the tools: " + ", ".join(functions),
        )
    where = f"tools[{list(functions).index(name)}].function.parameters"
    return ToolCalls(functions[name], name, where)


def _functions(tools: Any) -> dict[str, dict[str, Any]]:
    """Function name -> its parameter schema, checked."""
    if not isinstance(tools, list):
        raise InvalidParameterError("tools", "tools must be a list of function tools")
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise InvalidParameterError(
                where, f'{where} must be {{"type": "function", "function": {{...}}}}'
            )
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name) or name in functions:
            raise InvalidParameterError(
                f"{where}.function.name",
                f"{where}.function.name must be a new name of 1-64 letters, digits, _ or -, "
                f"got {name!r}",
            )
        params = fn.get("parameters", NO_PARAMETERS)
        if not isinstance(params, dict):
            raise InvalidParameterError(
                f"{where}.function.parameters",
                f"{where}.function.parameters must be a JSON schema object",
            )
        functions[name] = params
    return functions


def _named(tool_choice: Any) -> str:
    choice = tool_choice if isinstance(tool_choice, dict) else {}
    fn = choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if choice.get("type") != "function" or not isinstance(name, str):
        raise InvalidParameterError(
            "tool_choice",
            'tool_choice must be "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}',
        )
    return name
