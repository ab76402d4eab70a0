"""The OpenAI wire format of requests: the sampling fields both endpoints share
(`SamplingRequest`) and the completions request; the chat request is in chat_protocol.py,
its messages in messages.py, the response models in responses.py. Requests are validated
strictly, so a field of the wrong type is an error, not a silent conversion.

Requests accept OpenAI's sampling fields (logit_bias included) plus vLLM's extensions
(top_k, min_p, repetition_penalty, ignore_eos, min_tokens, stop_token_ids, ...), and
structured output (response_format, on completions too as in vLLM; vLLM's guided_* and
structured_outputs: see structured.py). Fields that would change the answer but that this
server cannot honour (image parts, suffix, ...) are refused by `check()` with
InvalidParameterError naming them, rather than silently ignored; other unknown fields are
ignored.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict

from pagedllm.engine.prompts import check_text
from pagedllm.entrypoints.server.structured import Structured, from_fields
from pagedllm.errors import UNSUPPORTED, InvalidParameterError
from pagedllm.sampling_params import RequestOutputKind, SamplingParams


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class SamplingRequest(BaseModel):
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
    # structured output (entrypoints/server/structured.py)
    response_format: dict[str, Any] | None = None
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
        self,
        max_tokens: int | None,
        logprobs: int | None,
        best_of: int | None = None,
        prompt_logprobs: int | None = None,
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
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            logit_bias=_token_keys(self.logit_bias),
            structured_outputs=structured.spec if (structured := self.structured()) else None,
            # a stream sends what is new at each step; a whole response, the end only
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
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
        return from_fields(
            guided, self.structured_outputs, self.response_format, self.text_format()
        )

    def text_format(self) -> dict[str, Any] | None:
        """The Responses API's `text.format` (responses_protocol.py); None elsewhere."""
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


class CompletionRequest(SamplingRequest):
    # text, token ids, or a batch of either: one engine request per prompt
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    best_of: int | None = None
    echo: bool = False
    suffix: Any = None

    def check(self) -> None:
        self.check_common()
        refuse({"suffix": bool(self.suffix)})
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

    @property
    def scores_prompt_only(self) -> bool:
        """echo with max_tokens 0: the prompt, scored, and nothing generated (the engine
        draws one token, left out of the response; entrypoints/server/echo.py)."""
        return self.echo and self.max_tokens == 0

    def sampling_params(self) -> SamplingParams:
        max_tokens = 1 if self.scores_prompt_only else self.max_tokens
        prompt_logprobs = self.logprobs if self.echo else None
        return self._params(max_tokens, self.logprobs, self.best_of, prompt_logprobs)

    def param_names(self) -> dict[str, str]:
        return self.structured_names()


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


def refuse(asked: dict[str, bool]) -> None:
    """InvalidParameterError for the first field the request asked for (True)."""
    for param, yes in asked.items():
        if yes:
            raise InvalidParameterError(
                param, f"{param} is not supported by this server", UNSUPPORTED
            )
