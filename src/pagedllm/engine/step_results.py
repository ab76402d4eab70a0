"""StepResults: what a step's drawn tokens do to its requests, one request at a time.

Each sample's tokens are appended one by one (kept proposals first) under the stop checks
and its grammar, beams advance and fork, prompt log-probabilities accumulate, and each
touched request gets its output. Whatever raises fails only its own request: it joins
`failed`, for the engine to abort (every block back to the pool); its output
(`failed_output`) carries the error.
"""

from __future__ import annotations

import contextlib
import logging
import time

from pagedllm.core.scheduler import Scheduler
from pagedllm.core.sequence import Request, Sequence
from pagedllm.engine.beam_search import BeamState, advance_beams
from pagedllm.engine.grammars import Grammars
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.outputs import RequestMetrics, RequestOutput
from pagedllm.engine.step_rows import StepRows, raise_row_errors, sampling_params
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.runner import PromptLogprobs, PromptLogprobsRow, SampledTokens

logger = logging.getLogger("pagedllm")


class StepResults:
    def __init__(
        self,
        scheduler: Scheduler,
        grammars: Grammars,
        output: OutputProcessor,
        beams: dict[str, BeamState],
    ) -> None:
        self.scheduler = scheduler
        self.grammars = grammars
        self.output = output
        self.beams = beams  # request id -> its beam search (the engine's)

    def process(
        self,
        sampled: SampledTokens,
        rows: StepRows,
        failed: dict[str, tuple[Request, BaseException]],
    ) -> list[RequestOutput]:
        """Each request's tokens, one request at a time: what raises joins `failed` (the
        caller fails those) and fails only its own request."""
        now = time.time()
        touched: list[Request] = []
        for req, row, scored in zip(
            rows.prompt_owners, rows.prompt_rows, sampled.prompt_logprobs, strict=True
        ):
            if req.request_id not in failed:
                try:
                    _add_prompt_logprobs(req, row, scored)
                except Exception as exc:
                    failed[req.request_id] = (req, exc)
        for request_id, (req, entries) in rows.samples.items():
            if request_id in failed:
                continue
            try:
                self._take_samples(req, entries, sampled)
            except Exception as exc:
                failed[request_id] = (req, exc)
                continue
            touched.append(req)
        for request_id, (req, entries) in rows.beams.items():
            if request_id in failed:
                continue
            try:
                raise_row_errors(sampled, [i for _, i in entries])
                self._advance_beams(req, entries, sampled.top_ids, sampled.top_logprobs)
            except Exception as exc:
                failed[request_id] = (req, exc)
                continue
            touched.append(req)
        outputs = []
        for req in touched:
            req.first_token_time = req.first_token_time or now
            try:
                out = self._finish_step_of(req, now)
            except Exception as exc:
                failed[req.request_id] = (req, exc)
                continue
            if out is not None:
                outputs.append(out)
        return outputs

    def _take_samples(
        self, req: Request, entries: list[tuple[Sequence, int]], sampled: SampledTokens
    ) -> None:
        """Append each sample's drawn tokens (from its row: kept proposals first, then
        its own) one by one, and check whether it stops after each: a stop, EOS or
        max_tokens among the kept proposals ends the sequence there."""
        params = sampling_params(req)
        raise_row_errors(sampled, [i for _, i in entries])
        for seq, i in entries:
            kept = sampled.accepted.get(i)
            if kept is not None:
                for j, token in enumerate(kept.token_ids):
                    self._append(
                        params, seq, token, kept.logprobs[j], kept.top_ids[j], kept.top_logprobs[j]
                    )
                    if seq.finish_reason is not None:
                        break
                if seq.finish_reason is not None:
                    continue
            token = sampled.token_ids[i]
            self._append(
                params, seq, token, sampled.logprobs[i], sampled.top_ids[i], sampled.top_logprobs[i]
            )

    def _append(
        self,
        params: SamplingParams,
        seq: Sequence,
        token: int,
        logprob: float,
        top_ids: list[int],
        top_logprobs: list[float],
    ) -> None:
        """One new token of `seq`: its log-probs, the grammar, the stop checks."""
        seq.token_ids.append(token)
        self.grammars.accept(seq.seq_id, token)
        seq.cumulative_logprob += logprob
        if params.logprobs is not None:
            seq.output_logprobs.append(_token_logprobs(token, logprob, top_ids, top_logprobs))
        self.output.check_stop(params, seq)
        if seq.finish_reason is None and self.grammars.terminated(seq.seq_id):
            seq.finish_reason = "stop"  # the grammar took its end (an EOS, ignore_eos)

    def _finish_step_of(self, req: Request, now: float) -> RequestOutput | None:
        for seq in [s for s in req.seqs if s.finish_reason is not None]:
            self.scheduler.finish_seq(req, seq)
            self.grammars.forget([seq])
        finished = not req.seqs
        beam = self.beams.get(req.request_id)
        if finished:
            self.beams.pop(req.request_id, None)
        return self.output.make_output(req, finished, now, beam)

    def failed_output(self, req: Request, exc: BaseException) -> RequestOutput:
        """The final output of `req`, failed by `exc`; the engine then aborts it."""
        logger.error(
            "request %s failed: %s: %s", req.request_id, type(exc).__name__, exc, exc_info=exc
        )
        for seq in req.seqs:
            seq.finish_reason = "error"
        out = None
        with contextlib.suppress(Exception):  # the output itself may be what failed
            out = self.output.make_output(req, True, time.time(), self.beams.get(req.request_id))
        if out is None:  # report none
            out = RequestOutput(
                req.request_id,
                req.prompt,
                req.prompt_token_ids,
                [],
                True,
                metrics=RequestMetrics(req.arrival_time, req.first_token_time, time.time()),
            )
        out.error = f"{type(exc).__name__}: {exc}"
        return out

    # ---------------------------------------------------------------- helpers
    def _advance_beams(
        self,
        req: Request,
        entries: list[tuple[Sequence, int]],
        top_ids: list[list[int]],
        top_logprobs: list[list[float]],
    ) -> None:
        def fork(parent: Sequence) -> Sequence:
            child = self.scheduler.new_seq(
                parent.token_ids, len(req.seqs), parent.num_prompt_tokens
            )
            self.scheduler.fork(req, parent, child)
            return child

        def drop(beam: Sequence) -> None:
            self.scheduler.finish_seq(req, beam, keep=False)

        beams = [seq for seq, _ in entries]
        top = [(top_ids[i], top_logprobs[i]) for _, i in entries]
        # When the search ends every beam is dropped, and with the last one the request.
        advance_beams(self.beams[req.request_id], beams, top, fork, drop)


def _add_prompt_logprobs(req: Request, row: PromptLogprobsRow, scored: PromptLogprobs) -> None:
    """Append the prompt tokens a step scored to the request's prompt log-probabilities."""
    req.prompt_logprobs.extend(
        _token_logprobs(token, logprob, ids, lps)
        for token, logprob, ids, lps in zip(
            row.target_ids, scored.logprobs, scored.top_ids, scored.top_logprobs, strict=True
        )
    )


def _token_logprobs(
    token: int, logprob: float, top_ids: list[int], top_logprobs: list[float]
) -> dict[int, float]:
    """A token's entry in the log-probabilities an output reports: the most likely tokens
    at its position, and itself."""
    top = dict(zip(top_ids, top_logprobs, strict=True))
    top[token] = logprob
    return top
