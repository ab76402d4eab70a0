"""The `/v1/completions` and `/v1/chat/completions` handlers: request -> SamplingParams and
prompt token ids (tokenized off the engine thread) -> engine -> OpenAI response (one JSON
body, or Server-Sent Events with `stream: true`). A completion's `prompt` may be a batch
(at most `max_prompts_per_request` prompts): prompt i's choices are i*n .. i*n+n-1, as in
vLLM, and usage is summed.

Both endpoints share one flow (`Serving.start`, then `Serving._respond`): check the
request, build its SamplingParams, encode its prompts, queue them (the async engine checks
that each could run, then compiles a grammar off its thread), then stream or collect and
count usage. Each endpoint says only what differs: how its prompts are encoded and
the shape of its choices. `/v1/responses` (responses_api.py) starts its requests with
`Serving.start` too, and answers in its own shape. Engine request ids are `cmpl-`,
`chatcmpl-` or `resp-` + the request id (the client's X-Request-Id, or one made for it) +
a running number, so that two clients that send the same X-Request-Id still get separate
engine requests.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

import pagedllm.entrypoints.server.responses as r
from pagedllm.engine.engine_client import EngineClient
from pagedllm.engine.outputs import RequestOutput
from pagedllm.entrypoints.server.body import model_not_found
from pagedllm.entrypoints.server.chat_protocol import ChatCompletionRequest
from pagedllm.entrypoints.server.echo import Echo
from pagedllm.entrypoints.server.errors import APIError, from_invalid_param
from pagedllm.entrypoints.server.limits import DEFAULT_MAX_PROMPTS_PER_REQUEST
from pagedllm.entrypoints.server.lora_modules import ServedModels
from pagedllm.entrypoints.server.metrics import ServerMetrics
from pagedllm.entrypoints.server.prompts import PromptEncoder
from pagedllm.entrypoints.server.protocol import CompletionRequest
from pagedllm.entrypoints.server.reasoning import (
    ReasoningParser,
    ReasoningStream,
    reasoning_tokens,
)
from pagedllm.entrypoints.server.request_id import request_id
from pagedllm.entrypoints.server.responses_protocol import ResponsesRequest
from pagedllm.entrypoints.server.streaming import (
    Delta,
    Generation,
    choice_deltas,
    collect,
    sse_response,
    submit,
)
from pagedllm.entrypoints.server.tool_parsers import DEFAULT_PARSER, PARSERS, ToolParser
from pagedllm.entrypoints.server.tool_stream import ToolCallStream
from pagedllm.entrypoints.server.tools import offered_tools
from pagedllm.errors import InvalidParameterError
from pagedllm.lora import LoRARequest
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger("pagedllm")
Choices = list[dict[str, Any]]


@contextmanager
def request_fields(fields: Mapping[str, str]) -> Iterator[None]:
    """InvalidParameterError (from the request's checks, SamplingParams, tokenization or
    the engine) -> 400 naming the request's field."""
    try:
        yield
    except InvalidParameterError as exc:
        raise from_invalid_param(exc, fields) from None


@dataclass
class Started:
    """A request the engine has taken: its response id, time and generation."""

    rid: str
    created: int
    model: str
    params: SamplingParams
    gen: Generation

    def body(self, obj: str, choices: Choices, usage: dict[str, Any] | None) -> dict[str, Any]:
        return {
            "id": self.rid,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage,
        }


def worth_sending(d: Delta, logprobs: int | None) -> bool:
    """Whether a stream chunk for `d` would tell the client anything."""
    return bool(d.text or d.finish_reason or (logprobs is not None and d.token_ids))


@dataclass
class Serving:
    engine: EngineClient
    metrics: ServerMetrics
    model_name: str
    # how the model writes a tool call (tool_parsers.py), read back under "auto"
    parser_factory: Callable[[Collection[str]], ToolParser] = PARSERS[DEFAULT_PARSER]
    max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST
    # splits a chat answer's reasoning from its content (reasoning.py); None: no split
    reasoning: ReasoningParser | None = None
    # the base's names and the LoRA adapters a request's `model` may pick; None: the base
    models: ServedModels | None = None
    encoder: PromptEncoder = field(init=False)

    def __post_init__(self) -> None:
        tokenizer = self.engine.tokenizer
        self.encoder = PromptEncoder(tokenizer)
        self._numbers = itertools.count()
        self._think = self.reasoning.think_tokens(tokenizer) if self.reasoning else None

        @lru_cache(maxsize=65536)
        def token_str(token_id: int) -> str:
            if tokenizer is None:
                return f"token_id:{token_id}"
            return tokenizer.decode([token_id])

        self.token_str = token_str

    # ------------------------------------------------------------ the shared flow
    async def start(
        self,
        req: CompletionRequest | ChatCompletionRequest | ResponsesRequest,
        raw: Request,
        prefix: str,
        encode: Callable[[], Awaitable[list[list[int]]]],
    ) -> Started:
        """Check, build the params, encode and queue: 400 naming the field, or 503."""
        arrival = time.monotonic()
        created = int(time.time())  # one value for every chunk of a stream, as OpenAI's
        client_id = request_id(raw)
        rid = f"{prefix}-{client_id}-{next(self._numbers)}"
        lora = self._adapter(req.model)
        with self._unloaded(req.model, lora), request_fields(req.param_names()):
            req.check()
            params = req.sampling_params()
            prompts = await encode()
            structured = req.structured()
            field = structured.field if structured is not None else None
            if field is not None and not isinstance(req, CompletionRequest):
                params = self._after_reasoning(params, field)
            gen = await submit(
                self.engine, self.metrics, rid, prompts, params, arrival, client_id, field, lora
            )
        logger.info(
            "request %s: %s, engine request %s, %d prompt(s)",
            client_id,
            raw.url.path,
            rid,
            len(prompts),
        )
        model = self.model_name if lora is None else lora.lora_name
        return Started(rid, created, model, params, gen)

    def _adapter(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter the request's `model` names (None: the base); 404 if the name
        is no longer served (unloaded since the body was read)."""
        if self.models is None:
            return None
        try:
            return self.models.lora(model)
        except KeyError:
            raise model_not_found(str(model), self.models.names()) from None

    @contextmanager
    def _unloaded(self, model: str | None, lora: LoRARequest | None) -> Iterator[None]:
        """404 `model_not_found` for a request whose adapter was unloaded while it was
        being prepared (the engine refuses the retired id), as for one that came after."""
        try:
            yield
        except APIError as exc:
            if lora is not None and exc.status == 400 and self._retired(model, lora):
                assert self.models is not None
                raise model_not_found(str(model), self.models.names()) from None
            raise

    def _retired(self, model: str | None, lora: LoRARequest) -> bool:
        try:
            return self._adapter(model) != lora
        except APIError:
            return True

    def reasoning_tokens(self, token_ids: list[int]) -> int:
        """How many of an output's tokens are reasoning (reasoning.reasoning_tokens); 0
        without a reasoning parser, or on a vocabulary without the think tokens, where
        the count is not known."""
        if self.reasoning is None or self._think is None:
            return 0
        return reasoning_tokens(token_ids, self._think)

    def _after_reasoning(self, params: SamplingParams, field: str) -> SamplingParams:
        """Chat (and Responses API) params whose grammar (asked for by the request's
        `field`) starts after the reasoning, when the server splits reasoning;
        InvalidParameterError naming `field` when the model's vocabulary cannot show where
        the reasoning ends."""
        if self.reasoning is None:
            return params
        if self._think is None:
            raise InvalidParameterError(
                field,
                f"{field} cannot be used with the {self.reasoning.name} reasoning parser on "
                "this model: its vocabulary has no <think> and </think> tokens, so the "
                "grammar cannot tell where the answer starts",
            )
        return replace(params, think_tokens=self._think)

    async def _respond(
        self,
        s: Started,
        req: CompletionRequest | ChatCompletionRequest,
        raw: Request,
        objects: tuple[str, str],
        stream_choices: Callable[[int, RequestOutput], Iterable[Choices]],
        final_choices: Callable[[list[RequestOutput]], Choices],
    ) -> Response:
        """Stream or collect, with usage. `objects`: the `object` of a stream chunk and
        of a whole response; `stream_choices` gives the choices of each chunk for an
        output (with its prompt's position), `final_choices` those of the whole."""
        chunk_obj, whole_obj = objects
        if req.stream:

            def chunks(position: int, out: RequestOutput) -> Iterable[dict[str, Any]]:
                for choices in stream_choices(position, out):
                    yield s.body(chunk_obj, choices, None)

            def last() -> Iterable[dict[str, Any]]:
                if req.include_usage:
                    yield s.body(chunk_obj, [], s.gen.usage())

            return sse_response(s.gen, chunks, last)
        finals = await collect(raw, s.gen)
        return JSONResponse(s.body(whole_obj, final_choices(finals), s.gen.usage()))

    # ---------------------------------------------------------- completions
    async def completions(self, req: CompletionRequest, raw: Request) -> Response:
        s = await self.start(req, raw, "cmpl", lambda: self.encoder.prompts(self._batch(req)))
        k = req.logprobs
        n = s.params.n
        echo = Echo(await self._prompt_texts(req) if req.echo else [], req.scores_prompt_only)

        def deltas(position: int, out: RequestOutput) -> list[Delta]:
            found = choice_deltas(out, position * n)
            return [echo.apply(d, out, position) for d in found] if req.echo else found

        def choice(d: Delta) -> dict[str, Any]:
            lps = self._completion_logprobs(d, k) if k is not None else None
            return {
                "index": d.index,
                "text": d.text,
                "logprobs": lps,
                "finish_reason": d.finish_reason,
            }

        def stream_choices(position: int, out: RequestOutput) -> Iterable[Choices]:
            for d in deltas(position, out):
                if worth_sending(d, k):
                    yield [choice(d)]

        def final_choices(finals: list[RequestOutput]) -> Choices:
            return [choice(d) for i, out in enumerate(finals) for d in deltas(i, out)]

        objects = ("text_completion", "text_completion")
        return await self._respond(s, req, raw, objects, stream_choices, final_choices)

    def _batch(self, req: CompletionRequest) -> list[str] | list[list[int]]:
        """The request's prompts; InvalidParameterError past the server's batch limit."""
        prompts = req.prompts()
        limit = self.max_prompts_per_request
        if len(prompts) > limit:
            raise InvalidParameterError(
                "prompt",
                f"prompt is a batch of {len(prompts)} prompts; this server takes at most "
                f"{limit} in one request",
            )
        return prompts

    async def _prompt_texts(self, req: CompletionRequest) -> list[str]:
        """Each prompt's text, to echo: a prompt of token ids decoded (special tokens
        kept) on the tokenizer thread; without a tokenizer, empty."""
        has_tokenizer = self.engine.tokenizer is not None
        return [
            p if isinstance(p, str) else (await self.encoder.decode(p) if has_tokenizer else "")
            for p in req.prompts()
        ]

    def _completion_logprobs(self, d: Delta, k: int) -> dict[str, Any]:
        out = r.CompletionLogProbs()
        offset = 0
        for token, top in zip(d.token_ids, d.logprobs or [], strict=False):
            s = self.token_str(token)
            out.tokens.append(s)
            out.text_offset.append(offset)
            offset += len(s)
            if top is None:  # an echoed prompt's first token: nothing predicts it
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(top.get(token))
            best = sorted(top.items(), key=lambda kv: -kv[1])[:k]
            out.top_logprobs.append({self.token_str(t): lp for t, lp in best} if k else None)
        return r.dump(out)

    # ----------------------------------------------------------------- chat
    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Response:
        async def encode() -> list[list[int]]:
            conversation, tools = req.conversation(), offered_tools(req.tool_use())
            return [await self.encoder.chat(conversation, req.add_generation_prompt, tools)]

        s = await self.start(req, raw, "chatcmpl", encode)
        k = (req.top_logprobs or 0) if req.logprobs else None
        use = req.tool_use()
        streams: dict[int, ToolCallStream] = {}  # with tools: each choice's call stream

        def tool_stream(index: int) -> ToolCallStream:
            assert use is not None
            return streams.setdefault(index, ToolCallStream(use, self.parser_factory))

        def finish(d: Delta) -> str | None:
            """ "tool_calls" for a choice that ended by itself after making calls."""
            made = use is not None and tool_stream(d.index).calls > 0
            return "tool_calls" if made and d.finish_reason == "stop" else d.finish_reason

        def lps(d: Delta) -> dict[str, Any] | None:
            return None if k is None else {"content": self._chat_logprobs(d, k)}

        def chunk(d: Delta, delta: dict[str, Any], reason: str | None) -> Choices:
            return [{"index": d.index, "delta": delta, "logprobs": lps(d), "finish_reason": reason}]

        thinking: dict[int, ReasoningStream] = {}  # with a reasoning parser: each choice's

        def split(d: Delta) -> tuple[str, str]:
            """(reasoning, content) that this piece of the choice's text completes."""
            if self.reasoning is None:
                return "", d.text
            stream = thinking.setdefault(d.index, self.reasoning.stream())
            return _feed(stream, d.text, d.finish_reason is not None)

        started: set[int] = set()

        def stream_choices(_: int, out: RequestOutput) -> Iterable[Choices]:
            for d in choice_deltas(out):
                if d.index not in started:  # each choice opens with its role
                    started.add(d.index)
                    first = {"role": "assistant", "content": ""}
                    yield [
                        {"index": d.index, "delta": first, "logprobs": None, "finish_reason": None}
                    ]
                reasoning, text = split(d)
                delta: dict[str, Any] = _reasoning_fields(reasoning) if reasoning else {}
                deltas: list[dict[str, Any]] = []
                if use is not None:
                    text, deltas = _feed(tool_stream(d.index), text, d.finish_reason is not None)
                if text:
                    delta["content"] = text
                if deltas:
                    delta["tool_calls"] = deltas
                if delta or d.finish_reason or (k is not None and d.token_ids):
                    yield chunk(d, delta, finish(d))

        def final_choices(finals: list[RequestOutput]) -> Choices:
            choices = []
            for d in choice_deltas(finals[0]):
                reasoning, text = (
                    (None, d.text) if self.reasoning is None else self.reasoning.split(d.text)
                )
                msg: dict[str, Any] = {"role": "assistant", "content": text}
                if self.reasoning is not None:
                    msg.update(_reasoning_fields(reasoning))
                if use is not None and text is not None:
                    whole = tool_stream(d.index).whole(text)
                    msg["content"] = whole.content
                    if whole.calls:
                        msg["tool_calls"] = whole.calls
                reason = finish(d)
                choices.append(
                    {"index": d.index, "message": msg, "logprobs": lps(d), "finish_reason": reason}
                )
            return choices

        objects = ("chat.completion.chunk", "chat.completion")
        return await self._respond(s, req, raw, objects, stream_choices, final_choices)

    def _chat_logprobs(self, d: Delta, k: int) -> list[dict[str, Any]]:
        content = []
        for token, top in zip(d.token_ids, d.logprobs or [], strict=False):
            s = self.token_str(token)
            best = sorted(top.items(), key=lambda kv: -kv[1])[:k]
            content.append(
                r.ChatTokenLogprob(
                    token=s,
                    logprob=top.get(token, float("-inf")),
                    bytes=list(s.encode()),
                    top_logprobs=[
                        r.TopLogprob(
                            token=self.token_str(t),
                            logprob=lp,
                            bytes=list(self.token_str(t).encode()),
                        )
                        for t, lp in best
                    ],
                )
            )
        return [r.dump(c) for c in content]


def _feed(stream: Any, text: str, last: bool) -> tuple[Any, Any]:
    """The two parts (reasoning and content, or content and tool-call deltas) that `text`
    completes in a choice's ReasoningStream or ToolCallStream; with `last` (the choice
    ended) what the stream held back too."""
    first, second = stream.feed(text)
    if last:
        more_first, more_second = stream.finish()
        first, second = first + more_first, second + more_second
    return first, second


def _reasoning_fields(reasoning: str | None) -> dict[str, str | None]:
    """A message's or delta's reasoning, under both of vLLM's names: `reasoning_content`
    (DeepSeek's, which most clients read) and `reasoning`, which vLLM sends too."""
    return {"reasoning_content": reasoning, "reasoning": reasoning}
