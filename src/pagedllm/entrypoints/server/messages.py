"""Chat messages on the wire: roles, text content parts, and tool-call history.

An assistant message may carry the `tool_calls` it made (OpenAI's shape: `id`, `type:
"function"`, `function: {name, arguments}` with `arguments` the JSON text of an object;
then `content` may be null), and a `tool` message carries a call's result (`tool_call_id`,
`content`), which must answer a call of an earlier assistant message (`check_tool_results`,
as OpenAI requires). `template_dict` gives each message as chat templates take it:
`arguments` as an object, as Hugging Face templates expect. A bad shape is an
InvalidParameterError naming the exact field (e.g.
`messages[2].tool_calls[0].function.arguments`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict

from pagedllm.bounded_json import JSONTooDeepError, loads
from pagedllm.errors import UNSUPPORTED, InvalidParameterError

ROLES = ("system", "developer", "user", "assistant", "tool")
# The most messages one conversation may hold (OpenAI's limit on chat `messages`); the
# Responses API's `input` items too.
MAX_MESSAGES = 2048


class ContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: Any = None

    def check(self, where: str) -> None:
        if self.role not in ROLES:
            raise InvalidParameterError(
                f"{where}.role",
                f"{where}.role must be one of {', '.join(ROLES)}, got {self.role!r}",
            )
        if self.role == "tool" and self.tool_call_id is None:
            raise InvalidParameterError(
                f"{where}.tool_call_id", f"{where}.tool_call_id is required for role 'tool'"
            )
        if self.tool_calls is not None:
            if self.role != "assistant":
                raise InvalidParameterError(
                    f"{where}.tool_calls", f"{where}.tool_calls is allowed on role 'assistant' only"
                )
            _calls(self.tool_calls, f"{where}.tool_calls")
        if self.content is None and not self.tool_calls:
            raise InvalidParameterError(f"{where}.content", f"{where}.content is required")
        for j, part in enumerate(self.content if isinstance(self.content, list) else ()):
            if part.type != "text" or part.text is None:
                raise InvalidParameterError(
                    f"{where}.content[{j}]",
                    f"{where}.content[{j}] must be a text part ({{'type': 'text', 'text': ...}}): "
                    f"this model reads text only, got type {part.type!r}",
                    UNSUPPORTED,
                )

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text or "" for p in self.content or ())

    def template_dict(self) -> dict[str, Any]:
        """The message as a chat template takes it (after `check`)."""
        # "developer" is OpenAI's new name for "system"; chat templates know the old one
        out: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": self.text(),
        }
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": call["id"],
                    "type": "function",
                    "function": {
                        "name": call["function"]["name"],
                        "arguments": loads(call["function"]["arguments"]),
                    },
                }
                for call in self.tool_calls
            ]
        return out


def check_messages(messages: Sequence[ChatMessage]) -> None:
    """At most MAX_MESSAGES; each message's `check`, then `check_tool_results`."""
    check_count(messages, "messages")
    for i, message in enumerate(messages):
        message.check(f"messages[{i}]")
    check_tool_results(messages)


def check_count(items: Sequence[Any], param: str) -> None:
    """InvalidParameterError naming `param` if a conversation has more than MAX_MESSAGES
    items."""
    if len(items) > MAX_MESSAGES:
        raise InvalidParameterError(
            param, f"{param} may hold at most {MAX_MESSAGES} items, got {len(items)}"
        )


def check_tool_results(messages: Sequence[ChatMessage]) -> None:
    """InvalidParameterError naming the first `tool` message whose tool_call_id is no call
    of an earlier assistant message (after each message's `check`)."""
    called: set[str] = set()
    for i, message in enumerate(messages):
        if message.role == "assistant" and message.tool_calls:
            called.update(call["id"] for call in message.tool_calls)
        elif message.role == "tool" and message.tool_call_id not in called:
            raise InvalidParameterError(
                f"messages[{i}].tool_call_id",
                f"messages[{i}].tool_call_id {message.tool_call_id!r} answers no tool call: "
                "no earlier assistant message made a call with that id"[:300],
            )


def _calls(calls: Any, where: str) -> None:
    """InvalidParameterError naming the first field of `calls` that is not OpenAI's shape."""
    if not isinstance(calls, list):
        raise InvalidParameterError(where, f"{where} must be a list of tool calls")
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(call, dict) or call.get("type", "function") != "function":
            raise InvalidParameterError(
                at, f'{at} must be {{"id": ..., "type": "function", "function": {{...}}}}'
            )
        if not isinstance(call.get("id"), str):
            raise InvalidParameterError(f"{at}.id", f"{at}.id must be a string")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise InvalidParameterError(
                f"{at}.function", f'{at}.function must be {{"name": str, "arguments": str}}'
            )
        check_arguments(fn.get("arguments"), f"{at}.function.arguments")


def check_arguments(args: Any, where: str) -> None:
    """InvalidParameterError naming `where` unless `args` is the JSON text of an object
    (a call's arguments)."""
    try:
        value = loads(args) if isinstance(args, str) else None
    except JSONTooDeepError as exc:
        raise InvalidParameterError(where, f"{where} {exc}") from None
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise InvalidParameterError(
            where, f"{where} must be the JSON text of an object, got {args!r}"[:300]
        )
