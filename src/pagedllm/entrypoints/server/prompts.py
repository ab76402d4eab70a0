"""Prompt token ids for server requests, computed on a tokenizer thread.

Tokenizing a long prompt or applying a chat template takes a while (a 1 MB prompt, most
of a second). On the engine thread it would stall every running stream; on the event
loop, every connection. So it runs on a thread of its own and the engine is handed token
ids. One thread rather than a pool: a Hugging Face fast tokenizer used by several threads
at once can fail ("Already borrowed"), and one thread already keeps both loops free.
The rules (valid Unicode, the chat template) are the offline API's: `engine.prompts`,
`chat_template.py`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from pagedllm.engine.prompts import encode_text
from pagedllm.entrypoints.server.chat_template import encode_chat

T = TypeVar("T")


class PromptEncoder:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._pool: ThreadPoolExecutor | None = None  # started at first use, again after close

    async def _run(self, fn: Callable[[], T]) -> T:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedllm-tokenizer")
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    async def prompts(self, prompts: Sequence[str | list[int]]) -> list[list[int]]:
        """Token ids of each prompt: text is tokenized, token ids pass through (the
        engine checks them against the vocabulary)."""
        tokenizer = self.tokenizer

        def encode() -> list[list[int]]:
            return [encode_text(tokenizer, p) if isinstance(p, str) else p for p in prompts]

        return await self._run(encode)

    async def chat(
        self,
        conversation: list[dict[str, Any]],
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
        add_special_tokens: bool = False,
    ) -> list[int]:
        tokenizer = self.tokenizer
        return await self._run(
            lambda: encode_chat(
                tokenizer,
                conversation,
                add_generation_prompt,
                tools=tools,
                add_special_tokens=add_special_tokens,
            )
        )

    async def text(self, text: str, add_special_tokens: bool) -> list[int]:
        """Token ids of one text, with or without the tokenizer's special tokens."""
        tokenizer = self.tokenizer
        return await self._run(lambda: encode_text(tokenizer, text, "prompt", add_special_tokens))

    async def decode(self, token_ids: list[int]) -> str:
        """The text of token ids, special tokens kept."""
        tokenizer = self.tokenizer
        return await self._run(lambda: str(tokenizer.decode(token_ids)))

    async def token_strs(self, token_ids: list[int]) -> list[str]:
        """Each token's own string in the vocabulary (e.g. "Ġworld")."""
        tokenizer = self.tokenizer
        return await self._run(lambda: list(tokenizer.convert_ids_to_tokens(token_ids)))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        self._pool = None
