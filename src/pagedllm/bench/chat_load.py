"""The client of a multi-turn chat load: plays conversations (bench/conversations.py)
against an OpenAI-compatible server, each turn a streamed chat completion that resends
the conversation so far, and records each turn's usage (cached prompt tokens included),
time to first text and latency."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from contextlib import aclosing
from typing import Any

from pagedllm.bench.conversations import Conversation, TurnRecord
from pagedllm.bench.sse_client import REQUEST_ERRORS, LoadClient, load_client


async def chat_turn(
    client: LoadClient, body: dict[str, Any], record: TurnRecord
) -> tuple[TurnRecord, str]:
    """One streamed chat completion: its record and the answer's text."""
    start, text = time.perf_counter(), []
    try:
        async with aclosing(client.stream("/v1/chat/completions", body)) as chunks:
            async for chunk in chunks:
                if "error" in chunk:
                    record.error = chunk["error"].get("message", "error")
                    return record, ""
                for choice in chunk.get("choices") or ():
                    piece = (choice.get("delta") or {}).get("content") or ""
                    if piece and record.ttft_s is None:
                        record.ttft_s = time.perf_counter() - start
                    text.append(piece)
                usage = chunk.get("usage")
                if usage:
                    record.prompt_tokens = usage["prompt_tokens"]
                    record.output_tokens = usage["completion_tokens"]
                    details = usage.get("prompt_tokens_details") or {}
                    record.cached_tokens = details.get("cached_tokens") or 0
    except (*REQUEST_ERRORS, KeyError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    record.latency_s = time.perf_counter() - start
    if not record.error and not record.prompt_tokens:
        record.error = "no usage in the stream"
    return record, "".join(text)


async def drive(
    url: str,
    conversations: Sequence[Conversation],
    output_len: int,
    api_key: str | None = None,
    max_concurrency: int | None = None,
    timeout: float = 300.0,
) -> tuple[list[TurnRecord], float]:
    """Every conversation against the server at `url`, turn after turn, each turn
    resending the conversation so far; the records and the seconds the whole took."""
    connections = max(100, len(conversations))
    async with load_client(url, api_key, connections, timeout) as client:
        model = await client.first_model()
        gate = asyncio.Semaphore(max_concurrency or len(conversations))

        async def converse(conversation: Conversation) -> list[TurnRecord]:
            messages: list[dict[str, str]] = []
            records = []
            async with gate:
                for turn, user in enumerate(conversation.user_turns):
                    messages.append({"role": "user", "content": user})
                    body = {"model": model, "messages": messages, "max_tokens": output_len}
                    body |= {"temperature": 0, "stream": True}
                    body["stream_options"] = {"include_usage": True}
                    record, answer = await chat_turn(
                        client, body, TurnRecord(conversation.index, turn)
                    )
                    records.append(record)
                    if record.error:
                        break
                    messages.append({"role": "assistant", "content": answer})
            return records

        start = time.perf_counter()
        done = await asyncio.gather(*map(converse, conversations))
        return [r for records in done for r in records], time.perf_counter() - start


async def warm_up(url: str, model: str, requests: int, api_key: str | None = None) -> None:
    """A few short completions sharing no prefix with the chats: each replica's first
    forward passes are not timed."""
    async with load_client(url, api_key, max(100, requests), 300) as client:
        bodies = [{"model": model, "prompt": f"{i} warm", "max_tokens": 2} for i in range(requests)]
        await asyncio.gather(*(client.post("/v1/completions", b) for b in bodies))
