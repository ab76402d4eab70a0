"""The `/v1/completions` and `/v1/chat/completions` handlers: request -> SamplingParams ->
engine -> OpenAI response (one JSON body, or Server-Sent Events with `stream: true`)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.engine.outputs import RequestOutput
from pagedllm.entrypoints.server import protocol as p
from pagedllm.entrypoints.server.errors import APIError
from pagedllm.entrypoints.server.metrics import ServerMetrics
from pagedllm.entrypoints.server.streaming import (
    ClientDisconnected,
    Delta,
    DeltaTracker,
    collect,
    sse_response,
    submit,
    usage_of,
)
from pagedllm.sampling_params import SamplingParams


@dataclass
class Serving:
    engine: AsyncLLMEngine
    metrics: ServerMetrics
    model_name: str

    def __post_init__(self) -> None:
        tokenizer = self.engine.engine.tokenizer

        @lru_cache(maxsize=65536)
        def token_str(token_id: int) -> str:
            if tokenizer is None:
                return f"token_id:{token_id}"
            return tokenizer.decode([token_id])

        self.token_str = token_str

    # ---------------------------------------------------------- completions
    async def completions(self, req: p.CompletionRequest, raw: Request) -> Response:
        if req.echo:
            raise APIError(400, "echo is not supported", param="echo")
        params = _sampling_params(req.sampling_params)
        if req.stream and params.best_of not in (None, params.n):
            raise APIError(400, "best_of must equal n when streaming", param="best_of")
        rid = f"cmpl-{uuid.uuid4().hex}"
        stream, tracker = await submit(
            self.engine, self.metrics, rid, req.prompt, params, time.monotonic(), "prompt"
        )
        k = req.logprobs

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
                "created": int(time.time()),
                "model": self.model_name,
                "choices": choices,
                "usage": usage,
            }

        deltas = DeltaTracker(params)
        if req.stream:

            def chunks(out: RequestOutput) -> Iterable[dict[str, Any]]:
                for d in deltas.deltas(out):
                    if d.text or d.finish_reason or (k is not None and d.token_ids):
                        yield body([choice(d)], None)

            return sse_response(stream, tracker, chunks, self._usage_chunk(req.include_usage, body))
        final = await self._final(raw, stream, tracker)
        return JSONResponse(body([choice(d) for d in deltas.deltas(final)], usage_of(final)))

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
        params = _sampling_params(req.sampling_params)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        conversation = req.conversation()
        tokenizer = self.engine.engine.tokenizer
        add_prompt = req.add_generation_prompt

        def encode() -> list[int]:  # runs on the engine thread
            if tokenizer is None or not getattr(tokenizer, "chat_template", None):
                raise ValueError("this model has no chat template")
            try:
                text = tokenizer.apply_chat_template(
                    conversation, tokenize=False, add_generation_prompt=add_prompt
                )
            except Exception as exc:
                raise ValueError(f"cannot apply the chat template: {exc}") from None
            return list(tokenizer.encode(text, add_special_tokens=False))

        stream, tracker = await submit(
            self.engine, self.metrics, rid, encode, params, time.monotonic(), "messages"
        )
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
                "created": int(time.time()),
                "model": self.model_name,
                "choices": choices,
                "usage": usage,
            }

        deltas = DeltaTracker(params)
        if req.stream:
            started: set[int] = set()

            def chunks(out: RequestOutput) -> Iterable[dict[str, Any]]:
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

            return sse_response(stream, tracker, chunks, self._usage_chunk(req.include_usage, body))
        final = await self._final(raw, stream, tracker)
        choices = [
            {
                "index": d.index,
                "message": {"role": "assistant", "content": d.text},
                "logprobs": lps(d),
                "finish_reason": d.finish_reason,
            }
            for d in deltas.deltas(final)
        ]
        return JSONResponse(body(choices, usage_of(final), "chat.completion"))

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
    ) -> Callable[[RequestOutput], Iterable[dict[str, Any]]]:
        def last(final: RequestOutput) -> Iterable[dict[str, Any]]:
            if include:
                yield body([], usage_of(final))

        return last

    @staticmethod
    async def _final(raw: Request, stream: Any, tracker: Any) -> RequestOutput:
        try:
            return await collect(raw, stream, tracker)
        except ClientDisconnected:
            raise APIError(499, "client closed the request", code="client_closed") from None


def _sampling_params(make: Callable[[], SamplingParams]) -> SamplingParams:
    try:
        return make()
    except ValueError as exc:
        message = str(exc)
        raise APIError(
            400, message, param=message.split(" ", 1)[0], code="invalid_sampling_params"
        ) from None
