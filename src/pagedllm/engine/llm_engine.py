"""LLMEngine: add_request / step / abort over the scheduler, the worker and the sampler.

`step()` is the whole serving loop in one iteration: schedule, run the model, note what
was computed, sample, then append tokens, detokenise, stop and fork sequences, and hand
back a RequestOutput for every request that gained a token.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence as Seq

import torch

from pagedllm.core.reservation import reserve_tokens
from pagedllm.core.scheduler import Scheduler, SchedulerConfig
from pagedllm.core.sequence import Request, Sequence
from pagedllm.engine.beam_search import BeamState, advance_beams
from pagedllm.engine.config import EngineConfig, parse_size
from pagedllm.engine.detokenizer import start_offsets
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.outputs import RequestOutput
from pagedllm.engine.stats import EngineStats
from pagedllm.kv.manager import KVCacheManager, KVUsage
from pagedllm.loader import LoadedModel, load_model
from pagedllm.model.llama import LlamaForCausalLM
from pagedllm.sampling_params import BeamSearchParams, SamplingParams
from pagedllm.worker.kv_cache import PagedKVCache, bytes_per_block
from pagedllm.worker.model_runner import ModelRunner
from pagedllm.worker.sampler import Sampler, SampleRow

logger = logging.getLogger("pagedllm")
_GREEDY = SamplingParams(temperature=0)


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        loaded = loaded if loaded is not None else load_model(config.model)
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.device = torch.device(config.device)
        dtype = getattr(torch, config.dtype)
        model = LlamaForCausalLM(loaded.config)
        model.load_weights(loaded.weights)
        self.model = model.to(device=self.device, dtype=dtype).eval()

        block_bytes = bytes_per_block(loaded.config, config.block_size, dtype)
        num_blocks = config.num_kv_blocks or max(
            1, parse_size(config.kv_cache_memory) // block_bytes
        )
        watermark_blocks = min(int(config.watermark * num_blocks), num_blocks - 1)
        # A request may grow to every block but the watermark.
        max_len = min(
            loaded.config.max_position_embeddings,
            (num_blocks - watermark_blocks) * config.block_size,
        )
        if config.max_model_len is not None:
            if config.max_model_len > loaded.config.max_position_embeddings:
                raise ValueError(
                    f"max_model_len ({config.max_model_len}) exceeds the model's context "
                    f"({loaded.config.max_position_embeddings})"
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
        self.kv_cache = PagedKVCache(
            loaded.config, num_blocks, config.block_size, dtype=dtype, device=self.device
        )
        self.runner = ModelRunner(self.model, self.kv_cache)
        self.sampler = Sampler(torch.Generator(device=self.device).manual_seed(config.seed))
        self.eos_token_ids = set(loaded.config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(int(self.tokenizer.eos_token_id))
        self.stats = EngineStats()
        self.last_scheduled_request_ids: tuple[str, ...] = ()  # what a failed step was doing
        self.output = OutputProcessor(self.tokenizer, self.eos_token_ids, max_len)
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
        """Queue a request; ValueError if it is malformed or could never fit.

        With BeamSearchParams the request runs a beam search in the engine.
        """
        params = params or SamplingParams()
        beam = None
        if isinstance(params, BeamSearchParams):
            beam = BeamState(params, frozenset(self.eos_token_ids))
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompt token ids")
            prompt_ids = list(self.tokenizer.encode(prompt, add_special_tokens=True))
        else:
            prompt_ids = [int(t) for t in prompt]
        if not prompt_ids:
            raise ValueError("prompt must contain at least one token")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab - 1}]")
        if beam is None and any(t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be in [0, {vocab - 1}]")
        if beam is not None and self._beam_candidates(params) > vocab:
            raise ValueError(f"beam_width must be at most {vocab // 2} for this vocabulary")
        num_seqs = params.beam_width if beam else params.num_seqs
        if num_seqs > 1 and self.config.kv_reservation != "paged":
            raise ValueError(
                f"kv_reservation={self.config.kv_reservation!r} is a one-sequence baseline: "
                "use n=1 (no best_of or beam search) or kv_reservation='paged'"
            )
        max_new = params.max_tokens or max(self.max_model_len - len(prompt_ids), 1)
        reserve = reserve_tokens(
            self.config.kv_reservation, len(prompt_ids), max_new, self.max_model_len
        )
        self.scheduler.check_fits(len(prompt_ids), max_new, num_seqs, reserve)
        seed = None if beam else params.seed
        seq = self._new_seq(prompt_ids, generator=self._generator(seed, 0))
        request = Request(
            request_id=request_id,
            seqs=[seq],
            max_num_seqs=num_seqs,
            beam=beam,
            reserve_tokens=reserve,
            params=params,
            arrival_time=time.time() if arrival_time is None else arrival_time,
            prompt=prompt if isinstance(prompt, str) else None,
        )
        self.scheduler.add_request(request)

    def abort(self, request_id: str) -> bool:
        """Stop a request now; every block it held returns to the pool."""
        req = self.scheduler.abort(request_id)
        if req is None:
            return False
        for seq in req.seqs:
            seq.finish_reason = "abort"
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.scheduler.requests)

    def usage(self) -> KVUsage:
        return self.kv.usage()

    # ------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        self.last_scheduled_request_ids = ()
        step = self.scheduler.schedule()
        self.last_scheduled_request_ids = tuple(step.num_scheduled_tokens)
        if step.is_empty:
            return []
        logits = self.runner.execute(step)
        self.scheduler.update_from_output(step)
        self.stats.record_step(step, self.scheduler, self.kv)

        # Rows of `logits` follow the scheduled sequences that need them, in order.
        rows: list[SampleRow] = []
        targets: list[tuple[Request, Sequence]] = []
        beam_rows: dict[str, list[tuple[Sequence, int]]] = {}
        row = 0
        for s in step.seqs:
            if not s.needs_logits:
                continue
            req = self.scheduler.requests[s.request_id]
            seq = next(q for q in req.seqs if q.seq_id == s.seq_id)
            if req.beam is not None:
                beam_rows.setdefault(req.request_id, []).append((seq, len(rows)))
                rows.append(SampleRow(row, _GREEDY, num_logprobs=self._beam_candidates(req.params)))
            else:
                for target in self._samples_for(req, seq):
                    rows.append(self._sample_row(row, req.params, target))
                    targets.append((req, target))
            row += 1
        if not rows:
            return []
        sampled = self.sampler(logits, rows)

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
            if req.params.logprobs is not None:
                top = dict(zip(sampled.top_ids[i], sampled.top_logprobs[i], strict=True))
                top[token] = sampled.logprobs[i]
                seq.output_logprobs.append(top)
            self.output.check_stop(req.params, seq)
            touched[req.request_id] = req
            if req.first_token_time is None:
                req.first_token_time = now
        outputs = []
        for req in touched.values():
            for seq in [s for s in req.seqs if s.finish_reason is not None]:
                self.scheduler.finish_seq(req, seq)
            outputs.append(self.output.make_output(req, finished=not req.seqs, now=now))
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
            child = self._new_seq(
                parent.token_ids,
                None,
                index=len(req.seqs),
                num_prompt_tokens=parent.num_prompt_tokens,
            )
            self.scheduler.fork(req, parent, child)
            return child

        def drop(beam: Sequence) -> None:
            self.scheduler.finish_seq(req, beam, keep=False)

        beams = [seq for seq, _ in entries]
        top = [(top_ids[i], top_logprobs[i]) for _, i in entries]
        # When the search ends every beam is dropped, and with the last one the request.
        advance_beams(req.beam, beams, top, fork, drop)

    def _new_seq(
        self,
        token_ids: list[int],
        generator: torch.Generator | None,
        index: int = 0,
        num_prompt_tokens: int | None = None,
    ) -> Sequence:
        seq = Sequence(
            seq_id=self.scheduler.new_seq_id(),
            token_ids=list(token_ids),
            num_prompt_tokens=len(token_ids) if num_prompt_tokens is None else num_prompt_tokens,
            index=index,
            sampler_state=generator,
        )
        start_offsets(seq)
        return seq

    def _generator(self, seed: int | None, index: int) -> torch.Generator | None:
        if seed is None:
            return None
        # Sample i of a seeded request draws from its own stream: reproducible whatever
        # else shares the batch.
        return torch.Generator(device=self.device).manual_seed(hash((seed, index)) & (2**63 - 1))

    def _samples_for(self, req: Request, seq: Sequence) -> list[Sequence]:
        """The sequences that draw a token from `seq`'s logits: at the first draw of a
        parallel-sampling request, the prompt's sequence forks into all its samples."""
        params = req.params
        if params.num_seqs == 1 or seq.num_output_tokens > 0 or len(req.seqs) > 1:
            return [seq]
        children = [seq]
        for i in range(1, params.num_seqs):
            child = self._new_seq(seq.token_ids, self._generator(params.seed, i), index=i)
            self.scheduler.fork(req, seq, child)
            children.append(child)
        return children

    def _sample_row(self, row: int, params: SamplingParams, seq: Sequence) -> SampleRow:
        n_out = seq.num_output_tokens
        suppressed: tuple[int, ...] = ()
        if n_out < params.min_tokens:
            eos = () if params.ignore_eos else tuple(self.eos_token_ids)
            suppressed = eos + tuple(params.stop_token_ids)
        penalties = params.has_penalties
        return SampleRow(
            logits_row=row,
            params=params,
            generator=seq.sampler_state,
            prompt_ids=seq.token_ids[: seq.num_prompt_tokens] if penalties else (),
            output_ids=seq.output_token_ids if penalties else (),
            suppressed_ids=suppressed,
            num_logprobs=params.logprobs or 0,
        )
