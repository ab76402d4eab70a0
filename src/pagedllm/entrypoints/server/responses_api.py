"""`POST /v1/responses`: a Responses API request (responses_protocol.py) run on the chat
path, answered as one `response` object or, with `stream: true`, as Server-Sent Events
(`event: <type>` and `data: {...}` with its `sequence_number`).

`ResponseBuilder` turns the generated text into output items as it arrives: with a
reasoning parser (`--reasoning-parser`, reasoning.py) a `reasoning` item (one
`reasoning_text` part) for the reasoning; for the answer, a `message` item (one
`output_text` part) for text and a `function_call` item for each tool call (read from the
answer as the chat endpoint reads it, tool_stream.py). It gives the events of each step:
`response.created`, `response.in_progress`, then per item `response.output_item.added`,
`response.content_part.added`, `response.output_text.delta`...,
`response.output_text.done`, `response.content_part.done` and
`response.output_item.done` (for a call, `response.function_call_arguments.delta`... and
`.done`; for reasoning, `response.reasoning_text.delta`... and `.done`, as vLLM sends
them), and last `response.completed` (or `response.incomplete`). A whole response runs the
same builder over the whole text and keeps the object, so a stream and a whole response
always agree. `output_tokens_details.reasoning_tokens` counts the reasoning's tokens, its
think tags included (Serving.reasoning_tokens).

A message item opens at the first text that is not only whitespace, and whitespace after
another item (a call, the reasoning) is dropped. An output that is only reasoning has no
message item. A response cut by `max_output_tokens` is "incomplete" (with
`incomplete_details.reason` "max_output_tokens"), and so is the item it cut. A request the
engine fails mid-stream ends with an `error` event.
"""

from __future__ import annotations

import copy
import itertools
import json
import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagedllm.engine.outputs import RequestOutput
from pagedllm.entrypoints.server.errors import APIError
from pagedllm.entrypoints.server.reasoning import ReasoningStream
from pagedllm.entrypoints.server.responses_protocol import ResponsesRequest
from pagedllm.entrypoints.server.serving import Serving, Started
from pagedllm.entrypoints.server.streaming import choice_deltas, collect, sse_response
from pagedllm.entrypoints.server.tool_stream import Delta, ToolCallStream
from pagedllm.entrypoints.server.tools import offered_tools

Event = dict[str, Any]


class ResponseBuilder:
    """The output items of one response, built from its text; each step returns its
    stream events."""

    def __init__(
        self,
        response: dict[str, Any],
        calls: ToolCallStream | None,
        reasoning: ReasoningStream | None = None,
    ) -> None:
        self.response = response  # its `output` grows as items open
        self.calls = calls  # None: no tools, the answer is all message
        self.reasoning = reasoning  # None: no reasoning parser, the text is all answer
        self._numbers = itertools.count()
        self._open: dict[str, Any] | None = None  # the item still growing
        self._pending = ""  # whitespace that may yet open a message

    def event(self, kind: str, **fields: Any) -> Event:
        return {"type": kind, "sequence_number": next(self._numbers), **fields}

    def start(self) -> list[Event]:
        snapshot = copy.deepcopy(self.response)
        return [
            self.event("response.created", response=snapshot),
            self.event("response.in_progress", response=snapshot),
        ]

    def feed(self, text: str) -> list[Event]:
        """The events of newly generated text."""
        if self.reasoning is None:
            return self._answer(text)
        return self._split(*self.reasoning.feed(text))

    def _split(self, reasoning: str, answer: str) -> list[Event]:
        return self._reasoning_text(reasoning) + self._answer(answer)

    def _answer(self, text: str) -> list[Event]:
        if self.calls is None:
            return self._text(text)
        return self._steps(self.calls.feed_in_order(text))

    def finish(self, reason: str | None, usage: dict[str, Any]) -> list[Event]:
        """The events of the end: `reason` is the choice's finish reason."""
        events = self._split(*self.reasoning.finish()) if self.reasoning is not None else []
        if self.calls is not None:
            events += self._steps(self.calls.finish_in_order())
        if not self.response["output"]:  # no item yet: the answer is a message, maybe empty
            events += self._open_message(self._pending)
        incomplete = reason == "length"
        status = "incomplete" if incomplete else "completed"
        events += self._close(status)
        self.response.update(
            status=status,
            completed_at=None if incomplete else int(time.time()),
            incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
            usage=usage,
        )
        kind = "response.incomplete" if incomplete else "response.completed"
        return [*events, self.event(kind, response=copy.deepcopy(self.response))]

    def _steps(self, steps: list[str | Delta]) -> list[Event]:
        events: list[Event] = []
        for step in steps:
            if isinstance(step, str):
                events += self._text(step)
            elif "id" in step:  # a call opens
                events += self._open_call(step)
            else:
                events += self._arguments(step["function"]["arguments"])
        return events

    # -------------------------------------------------------------- reasoning items
    def _reasoning_text(self, text: str) -> list[Event]:
        if not text:
            return []
        events: list[Event] = []
        item = self._open
        if item is None or item["type"] != "reasoning":
            events += self._close("completed")
            item = {
                "id": f"rs_{uuid.uuid4().hex}",
                "type": "reasoning",
                "summary": [],
                "content": [],
                "status": "in_progress",
            }
            events += self._add(item)
            item["content"].append({"type": "reasoning_text", "text": ""})
        item["content"][0]["text"] += text
        return [*events, self.event("response.reasoning_text.delta", **self._in_text(), delta=text)]

    # ---------------------------------------------------------------- message items
    def _text(self, text: str) -> list[Event]:
        if not text:
            return []
        if self._open is None or self._open["type"] != "message":
            self._pending += text
            if not self._pending.strip():
                return []
            # whitespace after a call is dropped
            text = self._pending.lstrip() if self.response["output"] else self._pending
            return self._open_message(text)
        part = self._open["content"][0]
        part["text"] += text
        return [
            self.event("response.output_text.delta", **self._in_text(), delta=text, logprobs=[])
        ]

    def _open_message(self, text: str) -> list[Event]:
        events = self._close("completed")
        item = {
            "id": f"msg_{uuid.uuid4().hex}",
            "type": "message",
            "role": "assistant",
            "status": "in_progress",
            "content": [],
        }
        events += self._add(item)
        part = {"type": "output_text", "text": "", "annotations": []}
        events.append(
            self.event("response.content_part.added", **self._in_text(), part=copy.deepcopy(part))
        )
        item["content"].append(part)
        part["text"] = text
        if text:
            events.append(
                self.event("response.output_text.delta", **self._in_text(), delta=text, logprobs=[])
            )
        return events

    # ----------------------------------------------------------- function_call items
    def _open_call(self, delta: Delta) -> list[Event]:
        events = self._close("completed")
        fn = delta["function"]
        item = {
            "id": f"fc_{uuid.uuid4().hex}",
            "type": "function_call",
            "call_id": delta["id"],
            "name": fn["name"],
            "arguments": "",
            "status": "in_progress",
        }
        return events + self._add(item) + self._arguments(fn["arguments"])

    def _arguments(self, text: str) -> list[Event]:
        if not text or self._open is None:
            return []
        self._open["arguments"] += text
        return [self.event("response.function_call_arguments.delta", **self._where(), delta=text)]

    # ------------------------------------------------------------------ any item
    def _add(self, item: dict[str, Any]) -> list[Event]:
        self._open, self._pending = item, ""
        self.response["output"].append(item)
        index = len(self.response["output"]) - 1
        return [
            self.event("response.output_item.added", output_index=index, item=copy.deepcopy(item))
        ]

    def _where(self) -> dict[str, Any]:
        """The open item's id and place, as its events name them."""
        assert self._open is not None
        return {"item_id": self._open["id"], "output_index": len(self.response["output"]) - 1}

    def _in_text(self) -> dict[str, Any]:
        """The open message's or reasoning's one text part, as its events name it."""
        return {**self._where(), "content_index": 0}

    def _close(self, status: str) -> list[Event]:
        """Close the open item, if any, with `status`."""
        item = self._open
        if item is None:
            return []
        where = self._where()
        events = []
        if item["type"] == "message":
            part, at = item["content"][0], self._in_text()
            events.append(
                self.event("response.output_text.done", **at, text=part["text"], logprobs=[])
            )
            events.append(self.event("response.content_part.done", **at, part=copy.deepcopy(part)))
        elif item["type"] == "reasoning":
            at = self._in_text()
            text = item["content"][0]["text"]
            events.append(self.event("response.reasoning_text.done", **at, text=text))
        else:
            events.append(
                self.event(
                    "response.function_call_arguments.done", **where, arguments=item["arguments"]
                )
            )
        item["status"] = status
        index = where["output_index"]
        events.append(
            self.event("response.output_item.done", output_index=index, item=copy.deepcopy(item))
        )
        self._open = None
        return events


def _usage(usage: dict[str, Any], reasoning_tokens: int) -> dict[str, Any]:
    """Chat's usage (streaming.Generation.usage) in the Responses API's names."""
    return {
        "input_tokens": usage["prompt_tokens"],
        # no cache write is asked for or billed here (OpenAI's prompt_cache_options)
        "input_tokens_details": {**usage["prompt_tokens_details"], "cache_write_tokens": 0},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": usage["total_tokens"],
    }


def _response(req: ResponsesRequest, s: Started) -> dict[str, Any]:
    """The response object before any output, echoing the request as OpenAI does."""
    return {
        "id": f"resp_{uuid.uuid4().hex}",
        "object": "response",
        "created_at": s.created,
        "status": "in_progress",
        "completed_at": None,
        "error": None,
        "incomplete_details": None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "metadata": req.metadata or {},
        "model": s.model,
        "output": [],
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": None,
        "reasoning": None,
        "temperature": s.params.temperature,
        "text": {**(req.text or {}), "format": req.text_format() or {"type": "text"}},
        "tool_choice": "auto" if req.tool_choice is None else req.tool_choice,
        "tools": req.tools or [],
        "top_p": s.params.top_p,
        "truncation": "disabled",
        "usage": None,
        "user": req.user,
    }


def _sse_event(event: Event) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


async def create_response(serving: Serving, req: ResponsesRequest, raw: Request) -> Response:
    async def encode() -> list[list[int]]:
        tools = offered_tools(req.tool_use())
        return [await serving.encoder.chat(req.template_messages(), True, tools)]

    s = await serving.start(req, raw, "resp", encode)
    use = req.tool_use()
    calls = ToolCallStream(use, serving.parser_factory) if use is not None else None
    thinking = serving.reasoning.stream() if serving.reasoning is not None else None
    builder = ResponseBuilder(_response(req, s), calls, thinking)
    token_ids: list[int] = []  # the output's, for its reasoning token count

    def usage() -> dict[str, Any]:
        return _usage(s.gen.usage(), serving.reasoning_tokens(token_ids))

    if req.stream:

        def events(_: int, out: RequestOutput) -> list[Event]:
            events: list[Event] = []
            for d in choice_deltas(out):
                token_ids.extend(d.token_ids)
                events += builder.feed(d.text)
                if d.finish_reason is not None:
                    events += builder.finish(d.finish_reason, usage())
            return events

        def failed(error: APIError) -> Event:
            return builder.event("error", code=error.code, message=error.message, param=error.param)

        # OpenAI's stream ends with its last event, without `data: [DONE]`
        return sse_response(
            s.gen,
            events,
            lambda: (),
            first=builder.start(),
            event=_sse_event,
            failed=failed,
            done="",
        )
    (final,) = await collect(raw, s.gen)
    (d,) = choice_deltas(final)
    token_ids.extend(d.token_ids)
    builder.feed(d.text)
    builder.finish(d.finish_reason, usage())
    return JSONResponse(builder.response)
