"""The chat completions request: messages (messages.py), the sampling fields it shares
with completions (protocol.py, response_format included), and tools (tools.py).

Tools are offered to the model through the chat template unless tool_choice is "none";
"required" and a named function constrain the output by grammar, so they cannot be
combined with another structured output; under "auto" a structured output holds the whole
output, and calls are parsed where its grammar let the model write them. OpenAI's older
`functions` / `function_call`, audio and predicted outputs are refused with
InvalidParameterError naming them.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from pagedllm.entrypoints.server.messages import ChatMessage, check_messages
from pagedllm.entrypoints.server.protocol import SamplingRequest, refuse
from pagedllm.entrypoints.server.structured import Structured
from pagedllm.entrypoints.server.tools import ToolUse, tool_use, with_tools
from pagedllm.errors import InvalidParameterError
from pagedllm.sampling_params import SamplingParams


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None  # false: at most one call
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    prediction: Any = None

    def check(self) -> None:
        self.check_common()
        check_messages(self.messages)
        # Asking for nothing (plain text) is fine; anything else would be ignored.
        refuse(
            {
                "functions": bool(self.functions),
                "function_call": self.function_call not in (None, "none"),
                "audio": self.audio is not None,
                "prediction": self.prediction is not None,
            }
        )
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidParameterError("top_logprobs", "top_logprobs needs logprobs: true")
        self.tool_use()

    def sampling_params(self) -> SamplingParams:
        max_tokens = self.max_completion_tokens
        if max_tokens is None:
            max_tokens = self.max_tokens
        top = (self.top_logprobs or 0) if self.logprobs else None
        return self._params(max_tokens, top)

    def param_names(self) -> dict[str, str]:
        """Engine parameter -> this request's field, for error objects."""
        max_tokens = "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"
        names = {"prompt": "messages", "max_tokens": max_tokens, "logprobs": "top_logprobs"}
        return {**names, **self.structured_names()}

    def tool_use(self) -> ToolUse | None:
        """How the request uses its tools (None: no tools, or tool_choice "none")."""
        return tool_use(self.tools, self.tool_choice, self.parallel_tool_calls is not False)

    def structured(self) -> Structured | None:
        return with_tools(super().structured(), self.tool_use(), self.tool_choice)

    def conversation(self) -> list[dict[str, Any]]:
        """The messages as the chat template takes them (after `check`)."""
        return [m.template_dict() for m in self.messages]
