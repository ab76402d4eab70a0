"""The OpenAI wire format: pydantic request models (validated strictly, so a field of the
wrong type is an error, not a silent conversion) and the response models.

Requests accept OpenAI's sampling fields (logit_bias included) plus vLLM's extensions
(top_k, min_p, repetition_penalty, ignore_eos, min_tokens, stop_token_ids, ...), and
structured output (chat's response_format, vLLM's guided_* and structured_outputs: see
structured.py). Fields that would change the answer but that this server cannot honour
(tools, image parts, suffix, ...) are refused by `check()` with InvalidParameterError
naming them, rather than silently ignored; other unknown fields are ignored.
"""

from __future__ import annotations

import re
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedllm.engine.prompts import check_text
from pagedllm.entrypoints.server.structured import Structured, from_fields
from pagedllm.entrypoints.server.tools import ToolCalls, tool_calls
from pagedllm.errors import UNSUPPORTED, InvalidParameterError
from pagedllm.sampling_params import SamplingParams, StructuredOutputs


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    logit_bias: dict[str, float] | None = None  # JSON keys: token ids as strings
    # vLLM extensions
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM's structured output (entrypoints/server/structured.py)
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None

    def check_common(self) -> None:
        """The checks both endpoints make of the fields they share."""
        if self.stream_options is not None and not self.stream:
            raise InvalidParameterError(
                "stream_options", "stream_options is only allowed with stream: true"
            )
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        for i, stop in enumerate(stops):
            # A lone surrogate could never match generated text: the request is a mistake.
            try:
                check_text(stop, "stop" if isinstance(self.stop, str) else f"stop[{i}]")
            except InvalidParameterError as exc:
                raise InvalidParameterError("stop", str(exc)) from None

    def _params(
        self, max_tokens: int | None, logprobs: int | None, best_of: int | None = None
    ) -> SamplingParams:
        """SamplingParams of the request; InvalidParameterError names the bad field."""
        return SamplingParams(
            n=self.n,
            best_of=best_of,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids or (),
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            logit_bias=_token_keys(self.logit_bias),
            structured_outputs=structured.spec if (structured := self.structured()) else None,
        )

    def structured(self) -> Structured | None:
        """The structured output the request asks for; InvalidParameterError names the
        field."""
        guided = {
            "guided_json": self.guided_json,
            "guided_regex": self.guided_regex,
            "guided_choice": self.guided_choice,
            "guided_grammar": self.guided_grammar,
        }
        return from_fields(guided, self.structured_outputs, self._response_format())

    def _response_format(self) -> dict[str, Any] | None:
        return None

    def structured_names(self) -> dict[str, str]:
        """Engine parameters of structured output -> the request's field."""
        try:
            structured = self.structured()
        except InvalidParameterError:  # named already, by the check that raised it
            return {}
        return structured.param_names() if structured else {}

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingRequest):
    # text, token ids, or a batch of either: one engine request per prompt
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    best_of: int | None = None
    echo: bool = False
    suffix: Any = None

    def check(self) -> None:
        self.check_common()
        _refuse({"echo": self.echo, "suffix": bool(self.suffix)})
        # The n best of best_of are known only at the end: a stream could not send them.
        if self.stream and self.best_of not in (None, self.n):
            raise InvalidParameterError("best_of", "best_of must equal n when streaming")

    def prompts(self) -> list[str] | list[list[int]]:
        """The batch: a single prompt is a batch of one (an empty list stays one, empty,
        prompt, so that the engine names it)."""
        p = self.prompt
        if isinstance(p, str) or not p or isinstance(p[0], int):
            return [p]  # type: ignore[list-item]
        return p  # type: ignore[return-value]

    def sampling_params(self) -> SamplingParams:
        return self._params(self.max_tokens, self.logprobs, self.best_of)

    def param_names(self) -> dict[str, str]:
        return self.structured_names()


ROLES = ("system", "developer", "user", "assistant", "tool")


class ContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: str
    content: str | list[ContentPart] | None = None
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
        _refuse({f"{where}.tool_calls": bool(self.tool_calls)})
        if self.content is None:
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


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    response_format: dict[str, Any] | None = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    prediction: Any = None

    def check(self) -> None:
        self.check_common()
        for i, message in enumerate(self.messages):
            message.check(f"messages[{i}]")
        # Asking for nothing (no tools, plain text) is fine; anything else would be ignored.
        _refuse(
            {
                "functions": bool(self.functions),
                "function_call": self.function_call not in (None, "none"),
                "audio": self.audio is not None,
                "prediction": self.prediction is not None,
            }
        )
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidParameterError("top_logprobs", "top_logprobs needs logprobs: true")

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

    def _response_format(self) -> dict[str, Any] | None:
        return self.response_format

    def tool_calls(self) -> ToolCalls | None:
        """The tool calls the request forces (tools + tool_choice), or None."""
        return tool_calls(self.tools, self.tool_choice)

    def structured(self) -> Structured | None:
        asked = super().structured()
        tools = self.tool_calls()
        if tools is None:
            return asked
        if asked is not None:
            raise InvalidParameterError(
                asked.field,
                f"{asked.field} cannot be combined with tool_choice {self.tool_choice!r}",
            )
        return Structured(StructuredOutputs(json=tools.schema), tools.field)

    def conversation(self) -> list[dict[str, str]]:
        # "developer" is OpenAI's new name for "system"; chat templates know the old one
        return [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in self.messages
        ]


# Plain decimal only: int() would also read "1_0" as 10, and " 7" or "+7" as 7. A leading
# "-" passes, so that the engine answers with the vocabulary's range.
_TOKEN_KEY = re.compile(r"-?[0-9]{1,18}")


def _token_keys(bias: dict[str, float] | None) -> dict[int, float] | None:
    if bias is None:
        return None
    for key in bias:
        if not _TOKEN_KEY.fullmatch(key):
            raise InvalidParameterError(
                "logit_bias",
                f"logit_bias keys must be token ids in decimal digits (at most 18), got {key!r}",
            )
    return {int(k): v for k, v in bias.items()}


def _refuse(asked: dict[str, bool]) -> None:
    """InvalidParameterError for the first field the request asked for (True)."""
    for param, yes in asked.items():
        if yes:
            raise InvalidParameterError(
                param, f"{param} is not supported by this server", UNSUPPORTED
            )


# ------------------------------------------------------------------ responses
class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedllm"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def dump(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(mode="json")
