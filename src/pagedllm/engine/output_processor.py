"""OutputProcessor: what happens to a sequence after it gains a token.

It detokenises incrementally, decides whether the sequence stops (EOS, a stop token, a
stop string — cut from the text — max_tokens or the context limit), and turns a request
into the RequestOutput the caller sees (best_of ranking, beam hypotheses best first).
"""

from __future__ import annotations

from collections.abc import Set
from typing import Any

from pagedllm.core.sequence import Request, Sequence
from pagedllm.engine.beam_search import BeamState
from pagedllm.engine.detokenizer import DetokenizerState, detokenize_incrementally
from pagedllm.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedllm.sampling_params import SamplingParams


class OutputProcessor:
    def __init__(self, tokenizer: Any, eos_token_ids: Set[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self._detok: dict[int, DetokenizerState] = {}  # by sequence id, while it runs

    def check_stop(self, params: SamplingParams, seq: Sequence) -> None:
        """Detokenise the newest token and set `seq.finish_reason` if the sequence ends."""
        self._check_stop(params, seq)
        if seq.finish_reason is not None:
            self._detok.pop(seq.seq_id, None)

    def forget(self, seqs: list[Sequence]) -> None:
        """Drop the state of sequences that ended without `check_stop` (aborts)."""
        for seq in seqs:
            self._detok.pop(seq.seq_id, None)

    def _check_stop(self, params: SamplingParams, seq: Sequence) -> None:
        token = seq.token_ids[-1]
        delta = ""
        if self.tokenizer is not None:
            state = self._detok.get(seq.seq_id)
            if state is None:
                state = self._detok[seq.seq_id] = DetokenizerState.start(seq)
            delta = detokenize_incrementally(self.tokenizer, seq, state, params.skip_special_tokens)
        if seq.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                seq.finish_reason = "stop"
                return
            if token in params.stop_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", token
                return
            if params.stop and delta and _cut_at_stop_string(seq, params, len(delta)):
                return
        if (params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens) or (
            seq.num_tokens >= self.max_model_len
        ):
            seq.finish_reason = "length"

    def make_output(
        self, req: Request, finished: bool, now: float, beam: BeamState | None = None
    ) -> RequestOutput:
        completions = (
            self._beam_completions(req, beam, finished)
            if beam is not None
            else self._sampled_completions(req, finished)
        )
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=completions,
            finished=finished,
            num_cached_tokens=req.num_cached_tokens,
            metrics=RequestMetrics(
                req.arrival_time, req.first_token_time, now if finished else None
            ),
            num_preemptions=req.num_preemptions,
        )

    @staticmethod
    def _sampled_completions(req: Request, finished: bool) -> list[CompletionOutput]:
        params = req.params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"request {req.request_id} is a beam search: it has no samples")
        seqs = req.finished_seqs + req.seqs
        if finished and params.best_of is not None and params.best_of > params.n:
            seqs = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)[: params.n]
        else:
            seqs = sorted(seqs, key=lambda s: s.index)
        return [
            CompletionOutput(
                index=i,
                text=s.output_text,
                token_ids=s.output_token_ids,
                cumulative_logprob=s.cumulative_logprob,
                logprobs=s.output_logprobs if params.logprobs is not None else None,
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
            )
            for i, s in enumerate(seqs)
        ]

    def _beam_completions(
        self, req: Request, beam: BeamState, finished: bool
    ) -> list[CompletionOutput]:
        """The finished hypotheses, best first, once the search is over."""
        completions = []
        for i, h in enumerate(beam.finished if finished else []):
            ended_by_eos = not beam.params.ignore_eos and h.token_ids[-1] in self.eos_token_ids
            text = ""
            if self.tokenizer is not None:
                text = self.tokenizer.decode(list(h.token_ids), skip_special_tokens=True)
            completions.append(
                CompletionOutput(
                    index=i,
                    text=text,
                    token_ids=list(h.token_ids),
                    cumulative_logprob=h.logprob,
                    logprobs=None,
                    finish_reason="stop" if ended_by_eos else "length",
                )
            )
        return completions


def _cut_at_stop_string(seq: Sequence, params: SamplingParams, new_chars: int) -> bool:
    """Look for a stop string ending in the newest text only: one that appeared before
    min_tokens was reached does not count, and the search does not grow with the output."""
    text = seq.output_text
    for stop in params.stop:
        at = text.find(stop, max(0, len(text) - new_chars - len(stop) + 1))
        if at >= 0:
            end = at + len(stop) if params.include_stop_str_in_output else at
            seq.output_text = seq.output_text[:end]
            seq.finish_reason, seq.stop_reason = "stop", stop
            return True
    return False
