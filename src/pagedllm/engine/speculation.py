"""Speculation: which requests propose tokens before a step, and what they kept after.

Before each step, every running request that decodes one sequence (n = 1, no best_of, no
beam search, no grammar: proposals are not checked against a grammar) gets up to k tokens,
capped so that its accepted tokens plus the model's own cannot pass max_tokens or
max_model_len: from the n-gram proposer (spec/ngram.py), or, with a draft model, k
placeholders that reserve the lookahead slots and logits rows, for the runner to replace
with the draft's proposals (worker/draft_model.py; `with_proposals` puts the real ones
back into the step). Nothing is proposed while as many sequences as
`disable_by_batch_size` or more are running. After the step, the runner's `accepted`
tokens say how far each such request's K/V counts as computed.
Plain bookkeeping: no torch.
"""

from __future__ import annotations

from dataclasses import replace

from pagedllm.core.scheduler import Scheduler, SchedulerOutput
from pagedllm.core.sequence import Request, RequestStatus
from pagedllm.engine.grammars import Grammars
from pagedllm.engine.step_rows import StepRows
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec.config import SpeculativeConfig
from pagedllm.spec.ngram import NgramProposer
from pagedllm.worker.runner import SampledTokens

# What a draft model's proposals are before the runner draws them: any valid token id.
PLACEHOLDER_TOKEN = 0


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

    def propose(self, scheduler: Scheduler) -> None:
        """Set `draft_token_ids` of each running request: its proposals this step, or
        none."""
        speculates = self.config.speculates_at(scheduler.num_running_seqs)
        for req in scheduler.running:
            room = self._room(req) if speculates else 0
            if room <= 0:
                req.draft_token_ids = []
            elif self.proposer is None:
                k = min(room, self.config.num_speculative_tokens)
                req.draft_token_ids = [PLACEHOLDER_TOKEN] * k
            else:
                req.draft_token_ids = self.proposer.propose(req.seqs[0].token_ids)[:room]

    def _room(self, req: Request) -> int:
        """How many tokens `req` may propose now: 0 unless it decodes one sequence."""
        params = req.params
        if (
            req.status is not RequestStatus.RUNNING
            or not isinstance(params, SamplingParams)
            or params.num_seqs != 1
            or len(req.seqs) != 1
            or req.num_tokens - req.num_computed_tokens != 1
        ):
            return 0
        seq = req.seqs[0]
        if self.grammars.get(seq.seq_id) is not None:
            return 0
        # k kept proposals and the model's own token must all fit: k + 1 new tokens.
        room = self.max_model_len - seq.num_tokens - 1
        if params.max_tokens is not None:
            room = min(room, params.max_tokens - seq.num_output_tokens - 1)
        return room

    @staticmethod
    def with_proposals(
        step: SchedulerOutput, rows: StepRows, sampled: SampledTokens
    ) -> SchedulerOutput:
        """`step` with the proposals the runner drew (a draft model's) in place of the
        placeholders, so that what follows sees the tokens that were checked."""
        if not sampled.proposals:
            return step
        drawn = {
            request_id: tuple(sampled.proposals[i])
            for request_id, i in rows.drafts.items()
            if i in sampled.proposals
        }
        seqs = []
        for s in step.seqs:
            real = drawn.get(s.request_id)
            if real is not None and s.draft_token_ids:
                k = len(s.draft_token_ids)
                if len(real) != k:
                    raise RuntimeError(
                        f"request {s.request_id}: the runner drew {len(real)} proposals "
                        f"for {k} slots"
                    )
                s = replace(s, token_ids=(*s.token_ids[:-k], *real), draft_token_ids=real)
            seqs.append(s)
        return replace(step, seqs=tuple(seqs))

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
