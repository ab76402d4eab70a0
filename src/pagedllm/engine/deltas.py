"""DeltaState: what a request's DELTA outputs have sent, so each carries only what is new.

Per sample: the output tokens (and their log-probs) and the characters of text sent so
far, and whether its end was. While a sample runs, the text a stop string could still cut
is held back (the longest stop string's length - 1, unless stop strings stay in the
output): a later delta never takes back text an earlier one sent. A sample with nothing
new is left out of the output, and one that ended is sent once more, with the rest of its
text and its finish reason, then never again (vLLM's rules for its parallel samples).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from pagedllm.core.sequence import Sequence
from pagedllm.engine.outputs import CompletionOutput
from pagedllm.sampling_params import SamplingParams


@dataclass
class _Sent:
    tokens: int = 0
    chars: int = 0
    finished: bool = False


@dataclass
class DeltaState:
    holdback: int  # characters of a running sample's text not sent yet
    with_logprobs: bool
    sent: dict[int, _Sent] = field(default_factory=dict)  # by sample index

    @classmethod
    def of(cls, params: SamplingParams) -> DeltaState:
        return cls(text_held_back(params), params.logprobs is not None)

    def completions(self, seqs: Iterable[Sequence]) -> list[CompletionOutput]:
        """What each of `seqs` (the request's samples, by index) gained since the last
        call; the samples with nothing new are left out."""
        out = []
        for s in seqs:
            sent = self.sent.get(s.index)
            if sent is None:
                sent = self.sent[s.index] = _Sent()
            done = s.finish_reason is not None
            tokens = s.num_output_tokens
            if sent.finished or (tokens == sent.tokens and not done):
                continue
            text = s.output_text
            end = len(text) if done else max(sent.chars, len(text) - self.holdback)
            out.append(
                CompletionOutput(
                    index=s.index,
                    text=text[sent.chars : end],
                    token_ids=s.token_ids[s.num_prompt_tokens + sent.tokens :],
                    cumulative_logprob=s.cumulative_logprob,
                    logprobs=s.output_logprobs[sent.tokens :] if self.with_logprobs else None,
                    finish_reason=s.finish_reason,
                    stop_reason=s.stop_reason,
                )
            )
            sent.tokens, sent.chars, sent.finished = tokens, end, done
        return out


def text_held_back(params: SamplingParams) -> int:
    """How many characters at the end of a running sample's text a stop string could
    still cut: one that completes with a later token may start that far back. 0 when
    stop strings stay in the output: the cut then falls after the text already there."""
    if params.include_stop_str_in_output:
        return 0
    return max((len(s) for s in params.stop), default=1) - 1
