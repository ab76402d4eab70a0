"""`echo` on `/v1/completions`: each choice's prompt returned before its generated text.

With `logprobs: k` the choice's log-probabilities then cover the prompt's tokens first
(OpenAI's legacy shape: `null` for the first token, which nothing predicts), computed by
the engine as SamplingParams.prompt_logprobs. With `max_tokens: 0` the prompt alone is
scored: the engine draws one token (it needs at least one), which is left out of the
choice. Streams work the same way: a choice's first chunk carries its prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.engine.outputs import RequestOutput
from pagedllm.entrypoints.server.streaming import Delta


@dataclass
class Echo:
    # each prompt's text: as sent, or a prompt of token ids decoded (on the tokenizer
    # thread, prompts.py: never on the event loop)
    texts: list[str]
    prompt_only: bool  # max_tokens 0: the prompt, scored, and no generated token
    _echoed: set[int] = field(default_factory=set)  # choices whose prompt went out
    # prompt position -> its token ids and scores, from the first output (the one that
    # carries them)
    _seen: dict[int, tuple[list[int], list[dict[int, float] | None] | None]] = field(
        default_factory=dict
    )

    def apply(self, d: Delta, out: RequestOutput, position: int) -> Delta:
        """`d` (a choice of the output of prompt `position`) with its prompt before it,
        the first time its choice is seen."""
        if out.prompt_token_ids is not None:
            self._seen.setdefault(position, (out.prompt_token_ids, out.prompt_logprobs))
        if d.index in self._echoed:
            return d
        self._echoed.add(d.index)
        ids, scored = self._seen.get(position, ([], None))
        logprobs = None
        if d.logprobs is not None:
            scored = scored or [None] * len(ids)
            logprobs = [*scored, *([] if self.prompt_only else d.logprobs)]
        text, token_ids = ("", []) if self.prompt_only else (d.text, d.token_ids)
        return Delta(
            d.index, self.texts[position] + text, [*ids, *token_ids], logprobs, d.finish_reason
        )
