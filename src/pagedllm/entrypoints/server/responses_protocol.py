"""The Responses API request (`POST /v1/responses`), read onto the chat path.

`input` is a string (one user message) or a list of items: messages (role user, system,
developer or assistant; content a string or `input_text` / `output_text` parts),
`function_call` items (an assistant's call, as a response's output gives it) and
`function_call_output` items (a call's result, answering an earlier call by `call_id`).
`reasoning` items are dropped: chat templates leave earlier reasoning out of the prompt.
`instructions` is a system message before the input. Function tools are written flat
(`{"type": "function", "name", "parameters", "strict"}`) and `text.format` holds the
structured output (`json_schema` with `name`, `schema`, `strict`; `json_object`; `text`);
both go the chat request's way (tools.py, structured.py). vLLM's sampling extensions
(top_k, seed, guided_*, ...) are taken too. `input` holds at most MAX_MESSAGES items
(messages.py) and `metadata`, echoed in the response, is bounded as OpenAI bounds it.

No response is stored: `previous_response_id`, `conversation` and item references are
refused (the client sends the whole conversation in `input`); `store` is accepted and
nothing is kept. Fields that would change the answer but that this server cannot honour
(background, prompt templates, other tools, logprobs, reasoning effort, truncation
"auto") are refused naming them, as on the chat endpoint.
"""

from __future__ import annotations

from typing import Any

from pagedllm.engine.prompts import check_text
from pagedllm.entrypoints.server.messages import ChatMessage, check_arguments, check_count
from pagedllm.entrypoints.server.protocol import SamplingRequest, refuse
from pagedllm.entrypoints.server.structured import Structured
from pagedllm.entrypoints.server.tools import ToolUse, tool_use, with_tools
from pagedllm.errors import UNSUPPORTED, InvalidParameterError
from pagedllm.sampling_params import SamplingParams

MESSAGE_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text")
# What `include` may name here: there is no encrypted reasoning to add, so nothing changes.
INCLUDABLE = ("reasoning.encrypted_content",)
# OpenAI's bounds on `metadata`, which the response echoes: pairs, key and value lengths.
MAX_METADATA = (16, 64, 512)
# Chat's fields -> this API's: refused by their chat names rather than ignored.
CHAT_NAMES = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
}


class ResponsesRequest(SamplingRequest):
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None  # false: at most one call
    text: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    include: list[str] | None = None
    truncation: str | None = None
    reasoning: dict[str, Any] | None = None
    # refused
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    prompt: Any = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None
    messages: Any = None  # chat's name for `input`

    def check(self) -> None:
        self.check_common()
        for name in ("previous_response_id", "conversation"):
            if getattr(self, name) is not None:
                raise InvalidParameterError(
                    name,
                    f"{name} refers to stored responses, and this server keeps none: send the "
                    "whole conversation in input",
                    UNSUPPORTED,
                )
        refuse(
            {
                "background": bool(self.background),
                "prompt": self.prompt is not None,
                "max_tool_calls": self.max_tool_calls is not None,
                "top_logprobs": bool(self.top_logprobs),
                "truncation": self.truncation not in (None, "disabled"),
                "reasoning.effort": (self.reasoning or {}).get("effort") is not None,
                "n": self.n != 1,
            }
        )
        for name, own in CHAT_NAMES.items():
            if getattr(self, name) is not None:
                raise InvalidParameterError(
                    name, f"{name} is a chat completions field; here it is {own}", UNSUPPORTED
                )
        for i, name in enumerate(self.include or ()):
            if name not in INCLUDABLE:
                raise InvalidParameterError(
                    f"include[{i}]", f"include[{i}] {name!r} is not supported by this server"
                )
        _check_metadata(self.metadata)
        self.chat_messages()
        self.tool_use()

    def sampling_params(self) -> SamplingParams:
        return self._params(self.max_output_tokens, None)

    def param_names(self) -> dict[str, str]:
        """Engine parameter -> this request's field, for error objects."""
        max_tokens = "max_output_tokens" if self.max_tokens is None else "max_tokens"
        names = {"prompt": "input", "messages": "input", "max_tokens": max_tokens}
        return {**names, **self.structured_names()}

    def text_format(self) -> dict[str, Any] | None:
        fmt = (self.text or {}).get("format")
        if fmt is not None and not isinstance(fmt, dict):
            raise InvalidParameterError("text.format", "text.format must be an object")
        return fmt

    def structured(self) -> Structured | None:
        return with_tools(super().structured(), self.tool_use(), self.tool_choice)

    def tool_use(self) -> ToolUse | None:
        """How the request uses its tools (None: no tools, or tool_choice "none")."""
        return tool_use(
            self.chat_tools(), self.tool_choice, self.parallel_tool_calls is not False, flat=True
        )

    def chat_tools(self) -> list[dict[str, Any]] | None:
        """The function tools in chat's shape (`{"type": "function", "function": {...}}`)."""
        if self.tools is None:
            return None
        out = []
        for i, tool in enumerate(self.tools):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise InvalidParameterError(
                    f"tools[{i}].type",
                    f"tools[{i}].type must be 'function' (the only tools this server runs), "
                    f"got {kind!r}",
                    UNSUPPORTED,
                )
            fields = ("name", "description", "parameters", "strict")
            out.append({"type": "function", "function": {k: tool[k] for k in fields if k in tool}})
        return out

    def chat_messages(self) -> list[ChatMessage]:
        """`instructions` and `input` as chat messages; InvalidParameterError names the
        item that is wrong."""
        messages = []
        if self.instructions is not None:
            check_text(self.instructions, "instructions")
            messages.append(ChatMessage(role="system", content=self.instructions))
        if isinstance(self.input, str):
            check_text(self.input, "input")
            return [*messages, ChatMessage(role="user", content=self.input)]
        if not self.input:
            raise InvalidParameterError("input", "input must hold at least one item")
        check_count(self.input, "input")
        called: set[str] = set()
        for i, item in enumerate(self.input):
            _item(item, f"input[{i}]", messages, called)
        return messages

    def template_messages(self) -> list[dict[str, Any]]:
        """The messages as the chat template takes them."""
        return [m.template_dict() for m in self.chat_messages()]


def _item(item: dict[str, Any], where: str, messages: list[ChatMessage], called: set[str]) -> None:
    """Add input item `item` (at `where`) to `messages`; `called`: the call ids so far."""
    kind = item.get("type", "message")
    if kind == "message":
        messages.append(ChatMessage(role=_role(item, where), content=_content(item, where)))
    elif kind == "function_call":
        call_id = _string(item, "call_id", where)
        called.add(call_id)
        args = item.get("arguments")
        check_arguments(args, f"{where}.arguments")
        call = {
            "id": call_id,
            "type": "function",
            "function": {"name": _string(item, "name", where), "arguments": args},
        }
        last = messages[-1] if messages else None
        # one assistant turn: its text, then its calls
        if last is not None and last.role == "assistant":
            last.tool_calls = last.tool_calls or []
            last.tool_calls.append(call)
        else:
            messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
    elif kind == "function_call_output":
        call_id = _string(item, "call_id", where)
        if call_id not in called:
            raise InvalidParameterError(
                f"{where}.call_id",
                f"{where}.call_id {call_id!r} answers no function_call item before it"[:300],
            )
        output = item.get("output")
        text = output if isinstance(output, str) else _parts(output, f"{where}.output")
        check_text(text, f"{where}.output")
        messages.append(ChatMessage(role="tool", content=text, tool_call_id=call_id))
    elif kind == "reasoning":
        pass  # earlier reasoning stays out of the prompt, as chat templates leave it out
    else:
        raise InvalidParameterError(
            f"{where}.type",
            f"{where}.type must be message, function_call, function_call_output or reasoning "
            f"(this server keeps no responses to refer to), got {kind!r}"[:300],
            UNSUPPORTED,
        )


def _check_metadata(metadata: dict[str, str] | None) -> None:
    pairs, key_len, value_len = MAX_METADATA
    if metadata is None:
        return
    if len(metadata) > pairs or any(
        len(k) > key_len or len(v) > value_len for k, v in metadata.items()
    ):
        raise InvalidParameterError(
            "metadata",
            f"metadata may hold at most {pairs} pairs, keys of at most {key_len} characters "
            f"and values of at most {value_len}",
        )


def _role(item: dict[str, Any], where: str) -> str:
    role = item.get("role")
    if role not in MESSAGE_ROLES:
        raise InvalidParameterError(
            f"{where}.role", f"{where}.role must be one of {', '.join(MESSAGE_ROLES)}, got {role!r}"
        )
    return role


def _content(item: dict[str, Any], where: str) -> str:
    content = item.get("content")
    text = content if isinstance(content, str) else _parts(content, f"{where}.content")
    check_text(text, f"{where}.content")
    return text


def _parts(parts: Any, where: str) -> str:
    """The text of a list of text parts."""
    if not isinstance(parts, list):
        raise InvalidParameterError(where, f"{where} must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        text = part.get("text") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(text, str):
            raise InvalidParameterError(
                f"{where}[{j}]",
                f"{where}[{j}] must be a text part ({{'type': 'input_text', 'text': ...}}): "
                f"this model reads text only, got type {kind!r}"[:300],
                UNSUPPORTED,
            )
        texts.append(text)
    return "".join(texts)


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise InvalidParameterError(f"{where}.{key}", f"{where}.{key} must be a string")
    return value
