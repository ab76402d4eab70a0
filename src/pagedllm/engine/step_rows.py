"""StepRows: the tokens one engine step draws (a SampleRow each), the prompt tokens it
scores (a PromptLogprobsRow per chunk) and whose they are; RowBuilder, which builds them
from the step's schedule.

Plain bookkeeping between the schedule and the engine's per-request processing: which
rows belong to which sampling request or beam search, which samples are forked at their
first draw, which row checks a sequence's proposed tokens, and which has a draft model
propose its next ones.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_output import ScheduledSeq, SchedulerOutput
from pagedllm.core.sequence import Request, Sequence
from pagedllm.engine.beam_search import BeamState
from pagedllm.engine.grammars import Grammars
from pagedllm.sampling_params import BeamSearchParams, SamplingParams
from pagedllm.worker.runner import PromptLogprobsRow, SampledTokens, SampleRow

_GREEDY = SamplingParams(temperature=0)


@dataclass
class StepRows:
    """The tokens a step draws: one SampleRow each, and whose they are."""

    rows: list[SampleRow] = field(default_factory=list)
    # request id -> (request, [(sample, its row)]) for sampling requests...
    samples: dict[str, tuple[Request, list[tuple[Sequence, int]]]] = field(default_factory=dict)
    # ... and for beam searches (a beam's row gives its candidates)
    beams: dict[str, tuple[Request, list[tuple[Sequence, int]]]] = field(default_factory=dict)
    forks: list[tuple[Request, Sequence, Sequence]] = field(default_factory=list)
    # request id -> the row of its one sample that checks proposed tokens
    drafts: dict[str, int] = field(default_factory=dict)
    # request id -> the row of its one sample whose next tokens a draft model proposes
    proposers: dict[str, int] = field(default_factory=dict)
    # Rows that follow a grammar, and their token bitmask (engine/grammars.py; row i of
    # it is the row whose grammar_row is i), None when no row has a grammar
    num_grammar_rows: int = 0
    grammar_bitmask: Any = None
    # The prompt tokens the step scores (SamplingParams.prompt_logprobs): row i for the
    # request prompt_owners[i]
    prompt_rows: list[PromptLogprobsRow] = field(default_factory=list)
    prompt_owners: list[Request] = field(default_factory=list)


def raise_row_errors(sampled: SampledTokens, rows: Iterable[int]) -> None:
    for i in rows:
        if i in sampled.row_errors:
            raise RuntimeError(f"sampling failed: {sampled.row_errors[i]}")


def sampling_params(req: Request) -> SamplingParams:
    if not isinstance(req.params, SamplingParams):
        raise TypeError(f"request {req.request_id} is a beam search, not a sampling request")
    return req.params


def beam_candidates(params: BeamSearchParams, eos_token_ids: Collection[int]) -> int:
    """Candidates kept per step, as transformers: enough that k survive any EOS."""
    num_eos = 0 if params.ignore_eos else len(eos_token_ids)
    return max(2, 1 + num_eos) * params.beam_width


def _prompt_row(req: Request, index: int, s: ScheduledSeq) -> PromptLogprobsRow | None:
    """The prompt tokens the chunk of `s` (the step's `index`-th sequence) predicts and
    `req` has not scored yet: position p's logits score token p + 1. None if none."""
    if not req.computes_prompt_logprobs or s.seq_id != req.prompt_seq.seq_id:
        return None
    if len(req.prompt_logprobs) < s.start_pos + 1:  # the scheduler computes such prompts whole
        raise RuntimeError("prompt tokens before this chunk were computed without their logits")
    prompt = req.prompt_token_ids
    first = len(req.prompt_logprobs)
    end = min(s.start_pos + len(s.token_ids) + 1, len(prompt))
    if first >= end:
        return None
    params = sampling_params(req)
    return PromptLogprobsRow(
        index, first - 1 - s.start_pos, tuple(prompt[first:end]), params.prompt_logprobs or 0
    )


class RowBuilder:
    """The rows of a step, built from its schedule and the engine's requests."""

    def __init__(
        self,
        scheduler: Scheduler,
        beams: dict[str, BeamState],
        grammars: Grammars,
        eos_token_ids: set[int],
    ) -> None:
        """`beams`: the engine's beam searches by request id (read, never changed)."""
        self.scheduler = scheduler
        self.beams = beams
        self.grammars = grammars
        self.eos_token_ids = eos_token_ids
        # Sequences whose penalty counts the runner holds (worker/penalty_rows.py): it
        # built them from the ids of an earlier row and drops them as it drops their tables,
        # when the sequence ends or is preempted. Not `replaces_tables`: a prompt's row
        # may come on a later chunk than its tables, a forked sample's row before its
        # tables, and copy-on-write sends tables whole again with the counts intact.
        self._counted: set[int] = set()

    def rows_of(
        self, step: SchedulerOutput
    ) -> tuple[StepRows, dict[str, tuple[Request, BaseException]]]:
        """The rows to draw, following the scheduled sequences that need logits in order,
        and the requests whose rows could not be built (they fail after the step)."""
        self._counted.difference_update(step.finished_seq_ids, step.preempted_seq_ids)
        rows = StepRows()
        failed: dict[str, tuple[Request, BaseException]] = {}
        logits_row = 0
        for i, s in enumerate(step.seqs):
            req = self.scheduler.requests[s.request_id]
            try:
                if req.request_id not in failed:
                    prompt_row = _prompt_row(req, i, s)
                    if prompt_row is not None:
                        rows.prompt_rows.append(prompt_row)
                        rows.prompt_owners.append(req)
                    if s.needs_logits:
                        self._add_rows(rows, logits_row, req, s.seq_id, s.draft_token_ids)
            except Exception as exc:
                failed[req.request_id] = (req, exc)
            logits_row += s.num_logits_rows
        if rows.num_grammar_rows:
            rows.grammar_bitmask = self.grammars.bitmask
        return rows, failed

    def _add_rows(
        self,
        rows: StepRows,
        logits_row: int,
        req: Request,
        seq_id: int,
        draft: tuple[int, ...] = (),
    ) -> None:
        """The rows that draw from logits row `logits_row` (sequence `seq_id`'s), which
        check the proposed tokens `draft` (its logits rows follow) if any."""
        seq = next(q for q in req.seqs if q.seq_id == seq_id)
        beam = self.beams.get(req.request_id)
        if beam is not None:
            rows.beams.setdefault(req.request_id, (req, []))[1].append((seq, len(rows.rows)))
            num = beam_candidates(beam.params, self.eos_token_ids)
            rows.rows.append(SampleRow(logits_row, seq.seq_id, _GREEDY, num_logprobs=num))
            return
        for target in self._samples_for(req, seq):
            if target is not seq:
                rows.forks.append((req, seq, target))
                # Before its row is built: the sample draws under its own matcher.
                self.grammars.fork(seq.seq_id, target.seq_id)
            rows.samples.setdefault(req.request_id, (req, []))[1].append((target, len(rows.rows)))
            row = self._sample_row(rows, logits_row, req, target)
            # Only a lone sample speculates: `target` is `seq`.
            if draft:
                row = replace(row, draft_token_ids=draft)
                rows.drafts[req.request_id] = len(rows.rows)
            if req.num_lookahead_tokens:
                row = replace(row, num_proposals=req.num_lookahead_tokens)
                rows.proposers[req.request_id] = len(rows.rows)
            rows.rows.append(row)

    def _samples_for(self, req: Request, seq: Sequence) -> list[Sequence]:
        """The sequences that draw a token from `seq`'s logits: at the first draw of a
        parallel-sampling request, the prompt's sequence and its new samples (forked from
        it by the caller)."""
        params = sampling_params(req)
        if params.num_seqs == 1 or seq.num_output_tokens > 0 or len(req.seqs) > 1:
            return [seq]
        return [
            seq,
            *(self.scheduler.new_seq(seq.token_ids, index=i) for i in range(1, params.num_seqs)),
        ]

    def _sample_row(self, rows: StepRows, row: int, req: Request, seq: Sequence) -> SampleRow:
        params = sampling_params(req)
        n_out = seq.num_output_tokens
        suppressed: tuple[int, ...] = ()
        grammar_row = -1
        if self.grammars.get(seq.seq_id) is not None:
            grammar_row = rows.num_grammar_rows
            self.grammars.fill_bitmask(seq.seq_id, grammar_row)
            rows.num_grammar_rows += 1
        # With a grammar, the grammar decides where the output may end: min_tokens does
        # not hold back its EOS (it could leave no token allowed).
        if n_out < params.min_tokens and grammar_row < 0:
            eos = () if params.ignore_eos else tuple(self.eos_token_ids)
            suppressed = eos + tuple(params.stop_token_ids)
        # Penalties read the sequence's tokens: sent once, then counted by the runner.
        send_ids = params.has_penalties and seq.seq_id not in self._counted
        if send_ids:
            self._counted.add(seq.seq_id)
        # Sample i of a seeded request draws from its own stream: reproducible whatever
        # else shares the batch.
        seed = None if params.seed is None else hash((params.seed, seq.index)) & (2**63 - 1)
        return SampleRow(
            logits_row=row,
            seq_id=seq.seq_id,
            params=params,
            seed=seed,
            prompt_ids=seq.token_ids[: seq.num_prompt_tokens] if send_ids else (),
            output_ids=seq.output_token_ids if send_ids else (),
            runner_counts=params.has_penalties and not send_ids,
            suppressed_ids=suppressed,
            num_logprobs=params.logprobs or 0,
            grammar_row=grammar_row,
            num_output_tokens=n_out,
        )
