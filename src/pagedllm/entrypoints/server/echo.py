"""`echo` on `/v1/completions`: each choice's prompt returned before its generated text.

With `logprobs: k` the choice's log-probabilities then cover the prompt's tokens first
(OpenAI's legacy shape: `null` for the first token, which nothing predicts), computed by
the engine as SamplingParams.prompt_logprobs. With `max_tokens: 0` the prompt alone is
scored: the engine draws one token (it needs at least one), which is left out of the
choice. Streams work the same way: a choice's first chunk carries its prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedllm.engine.outputs import RequestOutput
from pagedllm.entrypoints.server.streaming import Delta


@dataclass
class Echo:
    prompts: list[str] | list[list[int]]  # the request's prompts as it sent them
    tokenizer: Any
    prompt_only: bool  # max_tokens 0: the prompt, scored, and no generated token
    _echoed: set[int] = field(default_factory=set)  # choices whose prompt went out

    def apply(self, d: Delta, out: RequestOutput, position: int) -> Delta:
        """`d` (a choice of the output of prompt `position`) with its prompt before it,
        the first time its choice is seen (the output that carries the prompt)."""
        if d.index in self._echoed:
            return d
        self._echoed.add(d.index)
        ids = out.prompt_token_ids or []
        logprobs = None
        if d.logprobs is not None:
            scored = out.prompt_logprobs or [None] * len(ids)
            logprobs = [*scored, *([] if self.prompt_only else d.logprobs)]
        generated = Delta(d.index, "", [], [], d.finish_reason) if self.prompt_only else d
        return Delta(
            d.index,
            self._text(position, ids) + generated.text,
            [*ids, *generated.token_ids],
            logprobs,
            d.finish_reason,
        )

    def _text(self, position: int, ids: list[int]) -> str:
        prompt = self.prompts[position]
        if isinstance(prompt, str):
            return prompt
        return "" if self.tokenizer is None else self.tokenizer.decode(ids)
