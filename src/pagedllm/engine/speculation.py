"""Speculation: which requests check proposed tokens in a step, and what they kept after.

A request speculates when it decodes one sequence (n = 1, no best_of, no beam search, no
grammar: proposals are not checked against a grammar). Before each step, each such
request that decodes next gets up to k proposals as real tokens of its next chunk
(`Request.draft_token_ids`), capped so that its accepted tokens plus the model's own
cannot pass max_tokens or max_model_len: the n-gram proposer's (spec/ngram.py), or those
the runner's draft model drew after the previous step (worker/draft_model.py; the engine
keeps them on the request, `keep_proposals`). With a draft model each such request also
asks for lookahead slots (`Request.num_lookahead_tokens`), into which the draft writes
the proposals it draws after the step. Nothing is proposed while as many sequences as
`disable_by_batch_size` or more are running. After the step, the runner's `accepted`
tokens say how far each such request's K/V counts as computed.
Plain bookkeeping: no torch.
"""

from __future__ import annotations

from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.core.sequence import Request, RequestStatus
from pagedllm.engine.grammars import Grammars
from pagedllm.engine.step_rows import StepRows
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec.config import SpeculativeConfig
from pagedllm.spec.ngram import NgramProposer
from pagedllm.worker.runner import SampledTokens


class Speculation:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, grammars: Grammars) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.grammars = grammars
        self.proposer = (
            NgramProposer(
                config.prompt_lookup_min,
                config.prompt_lookup_max,
                config.num_speculative_tokens,
                max_model_len,
            )
            if config.method == "ngram"
            else None  # a draft model's proposals come from the runner
        )
        self.num_checks = 0  # sequence-steps that checked proposals
        self.num_proposed = 0
        self.num_accepted = 0

    @property
    def counts(self) -> tuple[int, int, int]:
        """(checks, proposed tokens, accepted tokens) so far, for the snapshot."""
        return self.num_checks, self.num_proposed, self.num_accepted

    def prepare(self, req: Request) -> None:
        """A new request: with a draft model, the lookahead its first step that reaches
        the prompt's end claims, so that the draft proposes for its first decode."""
        if self.proposer is None:
            k = self.config.num_speculative_tokens
            req.num_lookahead_tokens = max(0, min(k, self._room(req)))

    def propose(self, scheduler: Scheduler) -> None:
        """Before a step: set `draft_token_ids` of each running request (its proposals
        this step, or none) and, with a draft model, `num_lookahead_tokens`."""
        speculates = self.config.speculates_at(scheduler.num_running_seqs)
        k = self.config.num_speculative_tokens
        for req in scheduler.running:
            room = self._room(req) if speculates else 0
            decodes = room > 0 and req.num_tokens - req.num_computed_tokens == 1
            if self.proposer is not None:
                ids = req.seqs[0].token_ids
                req.draft_token_ids = self.proposer.propose(ids)[:room] if decodes else []
            else:
                # The draft's proposals are for a request that decodes, made after the
                # step before: cut to the room it has now.
                req.draft_token_ids = req.draft_token_ids[:room] if decodes else []
                req.num_lookahead_tokens = max(0, min(k, room - len(req.draft_token_ids)))

    def _room(self, req: Request) -> int:
        """How many tokens `req` may propose after its next token: 0 unless it is running
        or waiting with one sequence to decode, free of a grammar."""
        params = req.params
        if (
            req.status is RequestStatus.FINISHED
            or not isinstance(params, SamplingParams)
            or params.num_seqs != 1
            or len(req.seqs) != 1
        ):
            return 0
        seq = req.seqs[0]
        if self.grammars.follows(seq.seq_id):
            return 0
        # k kept proposals and the model's own token must all fit: k + 1 new tokens.
        room = self.max_model_len - seq.num_tokens - 1
        if params.max_tokens is not None:
            room = min(room, params.max_tokens - seq.num_output_tokens - 1)
        return room

    def accepted(
        self, step: SchedulerOutput, rows: StepRows, sampled: SampledTokens
    ) -> dict[str, list[int]]:
        """Request id -> the proposals its row kept, for each request that checked some
        (a row that failed keeps none); counted for the acceptance figures."""
        out: dict[str, list[int]] = {}
        for request_id, i in rows.drafts.items():
            kept = sampled.accepted.get(i)
            out[request_id] = list(kept.token_ids) if kept is not None else []
        for s in step.seqs:
            if s.draft_token_ids and s.request_id in out:
                self.num_checks += 1
                self.num_proposed += len(s.draft_token_ids)
                self.num_accepted += len(out[s.request_id])
        return out

    @staticmethod
    def keep_proposals(rows: StepRows, sampled: SampledTokens) -> None:
        """After the step's tokens are appended: each request whose row had the draft
        propose its next tokens keeps them for the next step, unless the step ended it."""
        for request_id, i in rows.proposers.items():
            req = rows.samples[request_id][0]
            if req.status is RequestStatus.RUNNING and req.seqs:
                req.draft_token_ids = list(sampled.next_proposals.get(i, ()))
