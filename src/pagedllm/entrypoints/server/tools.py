"""Tool calling: chat's `tools` and `tool_choice` -> how the output becomes tool calls.

* "auto" (the default when tools are given): the tools are offered through the chat
  template (chat_template.py) and the model's own call format is parsed from its text
  by the server's tool-call parser (tool_parsers.py); text outside the calls stays content.
* "required" or a named function: the output is constrained by a grammar to the call's
  JSON, so it parses whatever the model. A named function's output is its arguments (its
  parameter schema); "required" gives a JSON array of one or more `{"name", "parameters"}`
  calls, each one of the tools (vLLM's shape). The tools are offered to the model too.
* "none": the tools are not offered to the model, and nothing is parsed.

A function's `parameters` must be an object schema (`"type": "object"`), as OpenAI
requires: its arguments are an object. Its `strict` (a boolean) is honoured where a
grammar holds the arguments ("required", named): a keyword the grammar would not enforce
is then refused, as for `response_format` (structured.py). `parallel_tool_calls: false`
allows at most one call: "required" is held to a one-call array by its grammar, and under
"auto" the calls after the first are dropped (vLLM's way).

The Responses API (responses_protocol.py) writes a function flat (`{"type": "function",
"name", "parameters", ...}`, and `{"type": "function", "name"}` for tool_choice); it hands
the tools over in chat's shape, with `flat=True` so that errors name its own fields.

Calls carry ids `call_` + 24 hex digits; `finish_reason` is "tool_calls" when the output
ended by itself with at least one call. tool_stream.py turns the text into calls, in
pieces while streaming.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Literal

from pagedllm.bounded_json import JSONTooDeepError, check_depth
from pagedllm.entrypoints.server.structured import Structured, check_enforced
from pagedllm.errors import InvalidParameterError
from pagedllm.sampling_params import StructuredOutputs

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
MAX_TOOLS = 128  # tools one request may offer (OpenAI's limit)


@dataclass(frozen=True)
class ToolUse:
    """What a request's tools do. `schema` (with `field`, the request's field it comes
    from, for errors) constrains the output for "required" and "named"; `named` is the
    forced function's name."""

    mode: Literal["auto", "required", "named"]
    tools: tuple[dict[str, Any], ...]  # offered to the chat template
    functions: dict[str, dict[str, Any]]  # name -> parameter schema
    schema: dict[str, Any] | None = None
    field: str = "tools"
    named: str | None = None
    max_calls: int | None = None  # None: any number


def offered_tools(use: ToolUse | None) -> list[dict[str, Any]] | None:
    """The tools the chat template offers the model (none without tools or with
    tool_choice "none")."""
    return list(use.tools) if use is not None else None


def tool_use(
    tools: Any, tool_choice: Any, parallel_tool_calls: bool = True, flat: bool = False
) -> ToolUse | None:
    """How the request uses its tools, or None (no tools, or tool_choice "none");
    InvalidParameterError names the field that is wrong (`flat`: as the Responses API
    writes it, without `.function`)."""
    fn_path = "" if flat else ".function"
    if tool_choice == "none" or (not tools and tool_choice is None):
        if tools:
            _functions(tools, fn_path)  # checked all the same: a bad request is a bad request
        return None
    if not tools:
        raise InvalidParameterError("tool_choice", "tool_choice needs tools")
    functions = _functions(tools, fn_path)
    offered = tuple(tools)
    max_calls = None if parallel_tool_calls else 1
    if tool_choice in (None, "auto"):
        return ToolUse("auto", offered, functions, max_calls=max_calls)
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
        if max_calls is not None:
            schema["maxItems"] = max_calls
        _check_strict(tools, functions, fn_path)
        return ToolUse("required", offered, functions, schema, "tools", max_calls=max_calls)
    name = _named(tool_choice, flat)
    if name not in functions:
        raise InvalidParameterError(
            f"tool_choice{fn_path}.name",
            f"tool_choice{fn_path}.name {name!r} is not one of the tools: " + ", ".join(functions),
        )
    where = f"tools[{list(functions).index(name)}]{fn_path}.parameters"
    _check_strict(tools, {name}, fn_path)
    return ToolUse("named", offered, functions, functions[name], where, name)


def with_tools(
    asked: Structured | None, use: ToolUse | None, tool_choice: Any
) -> Structured | None:
    """The structured output of a request that asked for `asked` and uses its tools as
    `use`: a grammar of "required" or a named function, or else `asked`."""
    if use is None or use.schema is None:
        # "auto": the request's own grammar (if any) holds the whole output, and a
        # call is parsed where the grammar let the model write one
        return asked
    if asked is not None:
        raise InvalidParameterError(
            asked.field, f"{asked.field} cannot be combined with tool_choice {tool_choice!r}"
        )
    return Structured(StructuredOutputs(json=use.schema), use.field)


def _functions(tools: Any, fn_path: str) -> dict[str, dict[str, Any]]:
    """Function name -> its parameter schema, checked; errors name `tools[i]{fn_path}.x`."""
    if not isinstance(tools, list):
        raise InvalidParameterError("tools", "tools must be a list of function tools")
    if len(tools) > MAX_TOOLS:
        raise InvalidParameterError(
            "tools", f"tools may hold at most {MAX_TOOLS} tools, got {len(tools)}"
        )
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        fn_where = where + fn_path
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise InvalidParameterError(
                where, f'{where} must be {{"type": "function", "function": {{...}}}}'
            )
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name) or name in functions:
            raise InvalidParameterError(
                f"{fn_where}.name",
                f"{fn_where}.name must be a new name of 1-64 letters, digits, _ or -, got {name!r}",
            )
        params = fn.get("parameters", NO_PARAMETERS)
        if not isinstance(params, dict) or params.get("type") != "object":
            raise InvalidParameterError(
                f"{fn_where}.parameters",
                f'{fn_where}.parameters must be a JSON schema with "type": "object" '
                "(a function's arguments are an object)",
            )
        strict = fn.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise InvalidParameterError(
                f"{fn_where}.strict", f"{fn_where}.strict must be true or false"
            )
        try:  # the chat template writes it out, and a grammar may be built from it
            check_depth(params)
        except JSONTooDeepError as exc:
            raise InvalidParameterError(
                f"{fn_where}.parameters", f"{fn_where}.parameters {exc}"
            ) from None
        functions[name] = params
    return functions


def _check_strict(tools: list[dict[str, Any]], held: Collection[str], fn_path: str) -> None:
    """For each tool asking for `strict` whose arguments a grammar holds (`held`): every
    keyword of its parameters must be enforced (after `_functions`)."""
    for i, tool in enumerate(tools):
        fn = tool["function"]
        if fn.get("strict") and fn["name"] in held:
            check_enforced(fn.get("parameters", NO_PARAMETERS), f"tools[{i}]{fn_path}.parameters")


def _named(tool_choice: Any, flat: bool) -> str:
    choice = tool_choice if isinstance(tool_choice, dict) else {}
    fn = choice if flat else choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if choice.get("type") != "function" or not isinstance(name, str):
        shape = '"name": ...' if flat else '"function": {"name": ...}'
        raise InvalidParameterError(
            "tool_choice",
            f'tool_choice must be "none", "auto", "required" or {{"type": "function", {shape}}}',
        )
    return name
