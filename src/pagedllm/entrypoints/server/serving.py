"""The `/v1/completions` and `/v1/chat/completions` handlers: request -> SamplingParams and
prompt token ids (tokenized off the engine thread) -> engine -> OpenAI response (one JSON
body, or Server-Sent Events with `stream: true`). A completion's `prompt` may be a batch:
prompt i's choices are i*n .. i*n+n-1, as in vLLM, and usage is summed."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

import pagedllm.entrypoints.server.protocol as p
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.engine.outputs import RequestOutput
from pagedllm.entrypoints.server.errors import from_invalid_param
from pagedllm.entrypoints.server.metrics import ServerMetrics
from pagedllm.entrypoints.server.prompts import PromptEncoder
from pagedllm.entrypoints.server.streaming import (
    Delta,
    DeltaTracker,
    collect,
    sse_response,
    submit,
    usage_of,
)
from pagedllm.errors import InvalidParameterError


@contextmanager
def request_fields(fields: Mapping[str, str]) -> Iterator[None]:
    """InvalidParameterError (from the request's checks, SamplingParams, tokenization or
    the engine) -> 400 naming the request's field."""
    try:
        yield
    except InvalidParameterError as exc:
        raise from_invalid_param(exc, fields) from None


@dataclass
class Serving:
    engine: AsyncLLMEngine
    metrics: ServerMetrics
    model_name: str
    encoder: PromptEncoder = field(init=False)

    def __post_init__(self) -> None:
        tokenizer = self.engine.engine.tokenizer
        self.encoder = PromptEncoder(tokenizer)

        @lru_cache(maxsize=65536)
        def token_str(token_id: int) -> str:
            if tokenizer is None:
                return f"token_id:{token_id}"
            return tokenizer.decode([token_id])

        self.token_str = token_str

    # ---------------------------------------------------------- completions
    async def completions(self, req: p.CompletionRequest, raw: Request) -> Response:
        arrival = time.monotonic()
        created = int(time.time())  # one value for every chunk of a stream, as OpenAI's
        rid = f"cmpl-{uuid.uuid4().hex}"
        with request_fields(req.param_names()):
            req.check()
            params = req.sampling_params()
            prompts = await self.encoder.prompts(req.prompts())
            gen = await submit(self.engine, self.metrics, rid, prompts, params, arrival)
        k = req.logprobs
        n = params.n

        def choice(d: Delta) -> dict[str, Any]:
            lps = self._completion_logprobs(d, k) if k is not None else None
            return {
                "index": d.index,
                "text": d.text,
                "logprobs": lps,
                "finish_reason": d.finish_reason,
            }

        def body(choices: list[dict[str, Any]], usage: dict[str, int] | None) -> dict[str, Any]:
            return {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": self.model_name,
                "choices": choices,
                "usage": usage,
            }

        deltas = DeltaTracker(params)
        if req.stream:

            def chunks(position: int, out: RequestOutput) -> Iterable[dict[str, Any]]:
                for d in deltas.deltas(out, position * n):
                    if d.text or d.finish_reason or (k is not None and d.token_ids):
                        yield body([choice(d)], None)

            return sse_response(gen, chunks, self._usage_chunk(req.include_usage, body))
        finals = await collect(raw, gen)
        choices = [choice(d) for i, out in enumerate(finals) for d in deltas.deltas(out, i * n)]
        return JSONResponse(body(choices, usage_of(finals)))

    def _completion_logprobs(self, d: Delta, k: int) -> dict[str, Any]:
        out = p.CompletionLogProbs()
        offset = 0
        for token, top in zip(d.token_ids, d.logprobs or [], strict=False):
            s = self.token_str(token)
            out.tokens.append(s)
            out.token_logprobs.append(top.get(token))
            out.text_offset.append(offset)
            offset += len(s)
            best = sorted(top.items(), key=lambda kv: -kv[1])[:k]
            out.top_logprobs.append({self.token_str(t): lp for t, lp in best} if k else None)
        return p.dump(out)

    # ----------------------------------------------------------------- chat
    async def chat(self, req: p.ChatCompletionRequest, raw: Request) -> Response:
        arrival = time.monotonic()
        created = int(time.time())  # one value for every chunk of a stream, as OpenAI's
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        with request_fields(req.param_names()):
            req.check()
            params = req.sampling_params()
            ids = await self.encoder.chat(req.conversation(), req.add_generation_prompt)
            gen = await submit(self.engine, self.metrics, rid, [ids], params, arrival)
        k = (req.top_logprobs or 0) if req.logprobs else None

        def lps(d: Delta) -> dict[str, Any] | None:
            return None if k is None else {"content": self._chat_logprobs(d, k)}

        def body(
            choices: list[dict[str, Any]],
            usage: dict[str, int] | None,
            obj: str = "chat.completion.chunk",
        ) -> dict[str, Any]:
            return {
                "id": rid,
                "object": obj,
                "created": created,
                "model": self.model_name,
                "choices": choices,
                "usage": usage,
            }

        deltas = DeltaTracker(params)
        if req.stream:
            started: set[int] = set()

            def chunks(_: int, out: RequestOutput) -> Iterable[dict[str, Any]]:
                for d in deltas.deltas(out):
                    if d.index not in started:
                        started.add(d.index)
                        first = {
                            "index": d.index,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                        yield body([first], None)
                    if d.text or d.finish_reason or (k is not None and d.token_ids):
                        delta = {"content": d.text} if d.text else {}
                        yield body(
                            [
                                {
                                    "index": d.index,
                                    "delta": delta,
                                    "logprobs": lps(d),
                                    "finish_reason": d.finish_reason,
                                }
                            ],
                            None,
                        )

            return sse_response(gen, chunks, self._usage_chunk(req.include_usage, body))
        finals = await collect(raw, gen)
        choices = [
            {
                "index": d.index,
                "message": {"role": "assistant", "content": d.text},
                "logprobs": lps(d),
                "finish_reason": d.finish_reason,
            }
            for d in deltas.deltas(finals[0])
        ]
        return JSONResponse(body(choices, usage_of(finals), "chat.completion"))

    def _chat_logprobs(self, d: Delta, k: int) -> list[dict[str, Any]]:
        content = []
        for token, top in zip(d.token_ids, d.logprobs or [], strict=False):
            s = self.token_str(token)
            best = sorted(top.items(), key=lambda kv: -kv[1])[:k]
            content.append(
                p.ChatTokenLogprob(
                    token=s,
                    logprob=top.get(token, float("-inf")),
                    bytes=list(s.encode()),
                    top_logprobs=[
                        p.TopLogprob(
                            token=self.token_str(t),
                            logprob=lp,
                            bytes=list(self.token_str(t).encode()),
                        )
                        for t, lp in best
                    ],
                )
            )
        return [p.dump(c) for c in content]

    # -------------------------------------------------------------- helpers
    @staticmethod
    def _usage_chunk(
        include: bool, body: Callable[..., dict[str, Any]]
    ) -> Callable[[list[RequestOutput]], Iterable[dict[str, Any]]]:
        def last(finals: list[RequestOutput]) -> Iterable[dict[str, Any]]:
            if include:
                yield body([], usage_of(finals))

        return last
