"""OutputProcessor: what happens to a sequence after it gains a token.

It detokenises incrementally, decides whether the sequence stops (EOS, a stop token, a
stop string — cut from the text — max_tokens or the context limit), and turns a request
into the RequestOutput the caller sees, of the kind its params ask for: everything so far
(CUMULATIVE), what is new (DELTA, engine/deltas.py) or nothing until the end (FINAL_ONLY).
The n best of best_of samples and the beam hypotheses (best first) are known only at the
end: their DELTA request gets one output then, as FINAL_ONLY does.
"""

from __future__ import annotations

from collections.abc import Set
from typing import Any

from pagedllm.core.sequence import Request, Sequence
from pagedllm.engine.beam_search import BeamState
from pagedllm.engine.deltas import DeltaState
from pagedllm.engine.detokenizer import DetokenizerState, detokenize_incrementally
from pagedllm.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedllm.engine.step_rows import sampling_params
from pagedllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams


class OutputProcessor:
    def __init__(self, tokenizer: Any, eos_token_ids: Set[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self._detok: dict[int, DetokenizerState] = {}  # by sequence id, while it runs
        self._deltas: dict[str, DeltaState] = {}  # by request id, from its first DELTA output

    def check_stop(self, params: SamplingParams, seq: Sequence) -> None:
        """Detokenise the newest token and set `seq.finish_reason` if the sequence ends."""
        self._check_stop(params, seq)
        if seq.finish_reason is not None:
            self._detok.pop(seq.seq_id, None)

    def forget(self, req: Request) -> None:
        """Drop the state of a request that ended without a final output (aborts)."""
        for seq in req.seqs:
            self._detok.pop(seq.seq_id, None)
        self._deltas.pop(req.request_id, None)

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
    ) -> RequestOutput | None:
        """The request's output after a step that changed it; None if its kind gives
        none now (FINAL_ONLY, or a DELTA known only at the end, before the end)."""
        kind = req.params.output_kind
        if kind is RequestOutputKind.DELTA and beam is None and not _ranked(req.params):
            return self._delta_output(req, finished, now)
        if kind is not RequestOutputKind.CUMULATIVE and not finished:
            return None
        completions = (
            self._beam_completions(req, beam, finished)
            if beam is not None
            else self._sampled_completions(req, finished)
        )
        return _request_output(req, True, completions, finished, now)

    def _delta_output(self, req: Request, finished: bool, now: float) -> RequestOutput:
        state = self._deltas.get(req.request_id)
        first = state is None  # its first output: the only one with the prompt
        if state is None:
            state = self._deltas[req.request_id] = DeltaState.of(sampling_params(req))
        if finished:
            del self._deltas[req.request_id]
        seqs = req.finished_seqs + req.seqs
        if len(seqs) > 1:
            seqs.sort(key=lambda s: s.index)
        return _request_output(req, first, state.completions(seqs), finished, now)

    @staticmethod
    def _sampled_completions(req: Request, finished: bool) -> list[CompletionOutput]:
        params = sampling_params(req)
        seqs = req.finished_seqs + req.seqs
        if finished and _ranked(params):
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


def _ranked(params: SamplingParams | BeamSearchParams) -> bool:
    """Whether the request returns the n best of more samples, known only at the end."""
    return isinstance(params, SamplingParams) and params.num_seqs > params.n


def _request_output(
    req: Request,
    with_prompt: bool,
    completions: list[CompletionOutput],
    finished: bool,
    now: float,
) -> RequestOutput:
    return RequestOutput(
        request_id=req.request_id,
        prompt=req.prompt if with_prompt else None,
        prompt_token_ids=req.prompt_token_ids if with_prompt else None,
        outputs=completions,
        finished=finished,
        num_cached_tokens=req.num_cached_tokens,
        metrics=RequestMetrics(req.arrival_time, req.first_token_time, now if finished else None),
        num_preemptions=req.num_preemptions,
        prompt_logprobs=req.prompt_logprobs if with_prompt and _scored(req) else None,
    )


def _scored(req: Request) -> bool:
    """Whether the request asked for its prompt's log-probabilities and has them all."""
    return req.wants_prompt_logprobs and not req.computes_prompt_logprobs


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
