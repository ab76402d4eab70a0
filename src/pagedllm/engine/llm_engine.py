"""LLMEngine: add_request / step / abort over the scheduler and a model runner.

`step()` is the whole serving loop in one iteration: schedule, have the runner compute
the step and draw tokens, note what was computed, then append tokens, detokenise, stop
and fork sequences, and hand back a RequestOutput for every request that gained a token.
The engine itself holds no tensors: the runner does (worker/runner.py), so the same
`step()` drives the real model, a fake one for bookkeeping runs, or a split one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence as Seq
from typing import Any

from pagedllm.core.reservation import reserve_tokens
from pagedllm.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from pagedllm.core.sequence import Request, Sequence
from pagedllm.engine.beam_search import BeamState, advance_beams
from pagedllm.engine.config import EngineConfig, parse_size
from pagedllm.engine.kv_view import KVRecorder
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.outputs import RequestOutput
from pagedllm.engine.prompts import check_token_ids, encode_text
from pagedllm.engine.stats import EngineStats
from pagedllm.errors import InvalidParameterError, StepFailedError
from pagedllm.kv.manager import KVCacheManager, KVUsage
from pagedllm.sampling_params import BeamSearchParams, SamplingParams
from pagedllm.worker.runner import ModelRunner, SampledTokens, SampleRow

logger = logging.getLogger("pagedllm")
_GREEDY = SamplingParams(temperature=0)


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        loaded: Any = None,
        *,
        runner: ModelRunner | None = None,
        tokenizer: Any = None,
    ) -> None:
        """Build the engine over `runner`, or over the real model (`loaded`, else loaded
        from `config.model`) when no runner is given."""
        self.config = config
        if runner is None:
            # Imported here: an engine over a fake runner never loads torch.
            from pagedllm.worker.factory import build_runner
            from pagedllm.worker.options import RunnerOptions

            runner, tokenizer = build_runner(RunnerOptions.of(config), config.model, loaded)
        self.runner = runner
        self.tokenizer = tokenizer
        spec = runner.spec
        self.vocab_size = spec.vocab_size

        block_bytes = runner.kv_bytes_per_block(config.block_size)
        num_blocks = config.num_kv_blocks or max(
            1, parse_size(config.kv_cache_memory) // block_bytes
        )
        watermark_blocks = min(int(config.watermark * num_blocks), num_blocks - 1)
        # A request may grow to every block but the watermark.
        max_len = min(
            spec.max_position_embeddings, (num_blocks - watermark_blocks) * config.block_size
        )
        if config.max_model_len is not None:
            if config.max_model_len > spec.max_position_embeddings:
                raise InvalidParameterError(
                    "max_model_len",
                    f"max_model_len ({config.max_model_len}) exceeds the model's context "
                    f"({spec.max_position_embeddings})",
                )
            max_len = config.max_model_len
        self.max_model_len = max_len
        self.kv = KVCacheManager(
            num_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            watermark_blocks=watermark_blocks,
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_model_len=max_len,
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
            ),
            self.kv,
        )
        runner.init_kv_cache(num_blocks, config.block_size)
        self.eos_token_ids = set(spec.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(int(tokenizer.eos_token_id))
        self.stats = EngineStats()
        self.output = OutputProcessor(tokenizer, self.eos_token_ids, max_len)
        self._beams: dict[str, BeamState] = {}  # request id -> its beam search
        # The KV view's recorder while one watches (engine/kv_view.py); None costs nothing.
        self.kv_events: KVRecorder | None = None
        logger.info(
            "KV pool: %d blocks x %d tokens x %d bytes/block = %.1f MiB; max_model_len %d",
            num_blocks,
            config.block_size,
            block_bytes,
            num_blocks * block_bytes / 2**20,
            max_len,
        )

    # --------------------------------------------------------------- requests
    def add_request(
        self,
        request_id: str,
        prompt: str | Seq[int],
        params: SamplingParams | BeamSearchParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request; InvalidParameterError if it is malformed or could never fit.

        With BeamSearchParams the request runs a beam search in the engine.
        """
        params = params or SamplingParams()
        is_beam = isinstance(params, BeamSearchParams)
        if isinstance(prompt, str):
            prompt_ids = encode_text(self.tokenizer, prompt)
        else:
            prompt_ids = list(prompt)
        prompt_ids = check_token_ids(prompt_ids, self.vocab_size)
        vocab = self.vocab_size
        if isinstance(params, SamplingParams):
            if any(t >= vocab for t in params.stop_token_ids):
                raise InvalidParameterError(
                    "stop_token_ids", f"stop_token_ids must be in [0, {vocab - 1}]"
                )
            if any(t >= vocab for t in params.logit_bias or {}):
                raise InvalidParameterError(
                    "logit_bias", f"logit_bias keys must be token ids in [0, {vocab - 1}]"
                )
        elif self._beam_candidates(params) > vocab:
            raise InvalidParameterError(
                "beam_width", f"beam_width must be at most {vocab // 2} for this vocabulary"
            )
        num_seqs = params.beam_width if is_beam else params.num_seqs
        seqs_param = "beam_width" if is_beam else ("best_of" if params.best_of else "n")
        if num_seqs > 1 and self.config.kv_reservation != "paged":
            raise InvalidParameterError(
                seqs_param,
                f"kv_reservation={self.config.kv_reservation!r} is a one-sequence baseline: "
                "use n=1 (no best_of or beam search) or kv_reservation='paged'",
            )
        max_new = params.max_tokens or max(self.max_model_len - len(prompt_ids), 1)
        reserve = reserve_tokens(
            self.config.kv_reservation, len(prompt_ids), max_new, self.max_model_len
        )
        self.scheduler.check_fits(len(prompt_ids), max_new, num_seqs, reserve, seqs_param)
        seq = self._new_seq(prompt_ids)
        request = Request(
            request_id=request_id,
            seqs=[seq],
            max_num_seqs=num_seqs,
            reserve_tokens=reserve,
            params=params,
            arrival_time=time.time() if arrival_time is None else arrival_time,
            prompt=prompt if isinstance(prompt, str) else None,
        )
        self.scheduler.add_request(request)
        if is_beam:
            self._beams[request_id] = BeamState(params, frozenset(self.eos_token_ids))

    def abort(self, request_id: str) -> bool:
        """Stop a request now; every block it held returns to the pool."""
        req = self.scheduler.abort(request_id)
        if req is None:
            return False
        self._beams.pop(request_id, None)
        self.output.forget(req.seqs)
        for seq in req.seqs:
            seq.finish_reason = "abort"
        if self.kv_events is not None:
            self.kv_events.aborted(request_id)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.scheduler.requests)

    def usage(self) -> KVUsage:
        return self.kv.usage()

    def shutdown(self) -> None:
        self.runner.shutdown()

    # ------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """One iteration. If it fails after scheduling, StepFailedError names the
        requests the step was running (the caller decides what becomes of them)."""
        if self.kv_events is not None:  # the KV view watches: number this step's events
            self.kv_events.begin_step()
        step = self.scheduler.schedule()
        if step.is_empty:
            return []
        try:
            outputs = self._run(step)
        except Exception as exc:
            raise StepFailedError(tuple(step.num_scheduled_tokens), exc) from exc
        if self.kv_events is not None:
            self.kv_events.end_step(step, outputs)
        return outputs

    def _run(self, step: SchedulerOutput) -> list[RequestOutput]:
        # Rows to draw follow the scheduled sequences that need logits, in order.
        rows: list[SampleRow] = []
        targets: list[tuple[Request, Sequence]] = []
        beam_rows: dict[str, list[tuple[Sequence, int]]] = {}
        forks: list[tuple[Request, Sequence, Sequence]] = []  # (request, parent, new sample)
        row = 0
        for s in step.seqs:
            if not s.needs_logits:
                continue
            req = self.scheduler.requests[s.request_id]
            seq = next(q for q in req.seqs if q.seq_id == s.seq_id)
            beam = self._beams.get(req.request_id)
            if beam is not None:
                beam_rows.setdefault(req.request_id, []).append((seq, len(rows)))
                num = self._beam_candidates(beam.params)
                rows.append(SampleRow(row, seq.seq_id, _GREEDY, num_logprobs=num))
            else:
                for target in self._samples_for(req, seq):
                    rows.append(self._sample_row(row, req, target))
                    targets.append((req, target))
                    if target is not seq:
                        forks.append((req, seq, target))
            row += 1
        try:
            sampled = self.runner.execute(step, rows)
        except Exception:
            # Fork even so: the runner may have seeded generators for the samples, and
            # only sequences of the request are released when it is aborted.
            self._fork(forks)
            raise
        self.scheduler.update_from_output(step)
        # Forked once the prompt's blocks are hashed: the samples inherit the hashes
        # instead of hashing the prompt again each.
        self._fork(forks)
        self.stats.record_step(step, self.scheduler, self.kv)
        if not rows:
            return []
        return self._process(sampled, targets, beam_rows)

    def _process(
        self,
        sampled: SampledTokens,
        targets: list[tuple[Request, Sequence]],
        beam_rows: dict[str, list[tuple[Sequence, int]]],
    ) -> list[RequestOutput]:
        now = time.time()
        touched: dict[str, Request] = {}
        for request_id, entries in beam_rows.items():
            req = self.scheduler.requests[request_id]
            self._advance_beams(req, entries, sampled.top_ids, sampled.top_logprobs)
            touched[request_id] = req
            req.first_token_time = req.first_token_time or now
        for i, (req, seq) in enumerate(targets):
            token = sampled.token_ids[i]
            seq.token_ids.append(token)
            seq.cumulative_logprob += sampled.logprobs[i]
            params = req.params
            assert isinstance(params, SamplingParams)
            if params.logprobs is not None:
                top = dict(zip(sampled.top_ids[i], sampled.top_logprobs[i], strict=True))
                top[token] = sampled.logprobs[i]
                seq.output_logprobs.append(top)
            self.output.check_stop(params, seq)
            touched[req.request_id] = req
            if req.first_token_time is None:
                req.first_token_time = now
        outputs = []
        for req in touched.values():
            for seq in [s for s in req.seqs if s.finish_reason is not None]:
                self.scheduler.finish_seq(req, seq)
            finished = not req.seqs
            beam = self._beams.get(req.request_id)
            if finished:
                self._beams.pop(req.request_id, None)
            outputs.append(self.output.make_output(req, finished, now, beam))
        return outputs

    # ---------------------------------------------------------------- helpers
    def _beam_candidates(self, params: BeamSearchParams) -> int:
        """Candidates kept per step, as transformers: enough that k survive any EOS."""
        num_eos = 0 if params.ignore_eos else len(self.eos_token_ids)
        return max(2, 1 + num_eos) * params.beam_width

    def _advance_beams(
        self,
        req: Request,
        entries: list[tuple[Sequence, int]],
        top_ids: list[list[int]],
        top_logprobs: list[list[float]],
    ) -> None:
        def fork(parent: Sequence) -> Sequence:
            child = self._new_seq(parent.token_ids, len(req.seqs), parent.num_prompt_tokens)
            self.scheduler.fork(req, parent, child)
            return child

        def drop(beam: Sequence) -> None:
            self.scheduler.finish_seq(req, beam, keep=False)

        beams = [seq for seq, _ in entries]
        top = [(top_ids[i], top_logprobs[i]) for _, i in entries]
        # When the search ends every beam is dropped, and with the last one the request.
        advance_beams(self._beams[req.request_id], beams, top, fork, drop)

    def _new_seq(
        self, token_ids: list[int], index: int = 0, num_prompt_tokens: int | None = None
    ) -> Sequence:
        return Sequence(
            seq_id=self.scheduler.new_seq_id(),
            token_ids=list(token_ids),
            num_prompt_tokens=len(token_ids) if num_prompt_tokens is None else num_prompt_tokens,
            index=index,
        )

    def _samples_for(self, req: Request, seq: Sequence) -> list[Sequence]:
        """The sequences that draw a token from `seq`'s logits: at the first draw of a
        parallel-sampling request, the prompt's sequence and its new samples (forked from
        it by the caller)."""
        params = req.params
        assert isinstance(params, SamplingParams)
        if params.num_seqs == 1 or seq.num_output_tokens > 0 or len(req.seqs) > 1:
            return [seq]
        return [seq, *(self._new_seq(seq.token_ids, index=i) for i in range(1, params.num_seqs))]

    def _fork(self, forks: list[tuple[Request, Sequence, Sequence]]) -> None:
        for req, parent, child in forks:
            self.scheduler.fork(req, parent, child)

    def _sample_row(self, row: int, req: Request, seq: Sequence) -> SampleRow:
        params = req.params
        assert isinstance(params, SamplingParams)
        n_out = seq.num_output_tokens
        suppressed: tuple[int, ...] = ()
        if n_out < params.min_tokens:
            eos = () if params.ignore_eos else tuple(self.eos_token_ids)
            suppressed = eos + tuple(params.stop_token_ids)
        penalties = params.has_penalties
        # Sample i of a seeded request draws from its own stream: reproducible whatever
        # else shares the batch.
        seed = None if params.seed is None else hash((params.seed, seq.index)) & (2**63 - 1)
        return SampleRow(
            logits_row=row,
            seq_id=seq.seq_id,
            params=params,
            seed=seed,
            prompt_ids=seq.token_ids[: seq.num_prompt_tokens] if penalties else (),
            output_ids=seq.output_token_ids if penalties else (),
            suppressed_ids=suppressed,
            num_logprobs=params.logprobs or 0,
        )
