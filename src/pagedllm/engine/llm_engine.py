"""LLMEngine: add_request / step / abort over the scheduler and a model runner.

`step()` is the whole serving loop in one iteration: schedule, have the runner compute
the step and draw tokens, note what was computed, then append tokens, detokenise, stop
and fork sequences, and hand back a RequestOutput for every request that gained a token
(all it has so far, only what is new, or nothing until it ends: its params' `output_kind`).
The engine itself holds no tensors: the runner does (worker/runner.py), so the same
`step()` drives the real model, a fake one for bookkeeping runs, or a split one.

Structured output: a request whose SamplingParams carry `structured_outputs` comes with
its compiled grammar (the async engine compiles it off this thread, through
`compile_grammar`; offline, add_request compiles it), and each of its sequences gets a
matcher, kept here (plain bookkeeping, engine/grammars.py) and handed to the sampler with
the sequence's row. The matcher advances with each accepted token; when it accepts the
grammar's end the sequence stops ("stop").

A request's failure is its own: per-row work (sampling, grammar masks, detokenising, stop
checks, beam bookkeeping) that raises fails only its request, and a failed forward pass
fails only the requests of that step. A failed request is aborted (its blocks freed) and
comes back as a finished RequestOutput with `error` set; the others go on as they would
have (engine/step_results.py).

Prompt log-probabilities (SamplingParams.prompt_logprobs): each step that computes a
chunk of such a request's prompt has the runner score the prompt tokens it predicts
(a PromptLogprobsRow, engine/step_rows.py); they are kept on the request and given with
the prompt in its outputs.

Speculative decoding (`speculative_method="ngram"` or `"draft"`, engine/speculation.py):
before a step each eligible decoding request gets proposed tokens (the n-gram proposer's,
or those the runner's draft model drew after the previous step and reported with its
tokens), scheduled as real tokens; the step checks them in one forward pass over k+1
positions, and the request keeps the accepted ones (cut at a stop, EOS or max_tokens as
if drawn one by one) plus the model's own next token.

LoRA (`enable_lora`, docs/lora.md): a request may name a PEFT adapter of the base
(`lora_request`); the engine knows each adapter by its id (engine/lora_adapters.py), the
scheduler pins its pages in the pool while the request runs, and the runner computes the
request's rows under it.

Outside code reads the engine through `snapshot()` and listens through `add_listener()`
(engine/listeners.py) or `record_kv()`; nothing outside engine/ touches its scheduler,
block manager or runner.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any

from pagedllm.core.scheduler import Scheduler, SchedulerConfig
from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.core.sequence import Request, Sequence
from pagedllm.engine.beam_search import BeamState
from pagedllm.engine.config import EngineConfig
from pagedllm.engine.grammars import Grammars
from pagedllm.engine.kv_event_access import CurveKeys, who_may_subscribe
from pagedllm.engine.kv_pool_setup import build_kv_pool
from pagedllm.engine.kv_recorder import KVRecorder, Record, Sink, engine_snapshot
from pagedllm.engine.listeners import Listeners, StepListener
from pagedllm.engine.lora_adapters import KnownAdapter, LoRAAdapters
from pagedllm.engine.memory_check import check_memory
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.outputs import RequestOutput
from pagedllm.engine.request_checks import RequestChecks
from pagedllm.engine.snapshot import EngineSnapshot, take_snapshot
from pagedllm.engine.speculation import Speculation
from pagedllm.engine.stats import EngineStats
from pagedllm.engine.step_results import StepResults
from pagedllm.engine.step_rows import (
    RowBuilder,
    StepRows,
)
from pagedllm.kv.manager import KVUsage
from pagedllm.lora.request import LoRARequest
from pagedllm.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputs
from pagedllm.worker.runner import (
    ModelRunner,
)

if TYPE_CHECKING:
    from pagedllm.engine.kv_event_publisher import KVEventPublisher

logger = logging.getLogger("pagedllm")


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
        from `config.model`) when no runner is given: then the quantizations "auto" are
        decided first, and `self.config` holds the paths taken."""
        if runner is None:
            # Imported here: an engine over a fake runner never loads torch.
            from pagedllm.worker.factory import build_runner
            from pagedllm.worker.quantization_choice import resolve_quantization

            config = config.with_quantizations_of(
                resolve_quantization(config.runner_options, config.model, loaded)
            )
            if loaded is None:
                check_memory(config)  # before any weight is read
            runner, tokenizer = build_runner(config.runner_options, config.model, loaded)
        self.config = config
        self.runner = runner
        self.tokenizer = tokenizer
        spec = runner.spec
        self.vocab_size = spec.vocab_size
        pool = build_kv_pool(config, runner)
        self.kv, max_len = pool.kv, pool.max_model_len
        self.max_model_len = max_len
        self.loras = LoRAAdapters(
            config.enable_lora, lambda path: runner.adapter_pages(path, config.block_size)
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_model_len=max_len,
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
            ),
            self.kv,
        )
        self.eos_token_ids = set(spec.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(int(tokenizer.eos_token_id))
        self.checks = RequestChecks(
            tokenizer,
            self.vocab_size,
            frozenset(self.eos_token_ids),
            max_len,
            config.kv_reservation,
            self.scheduler.check_fits,
        )
        self.output = OutputProcessor(tokenizer, self.eos_token_ids, max_len)
        self._beams: dict[str, BeamState] = {}  # request id -> its beam search
        self.grammars = Grammars(
            tokenizer, self.vocab_size, self.eos_token_ids, int(config.grammar_cache_mb * 2**20)
        )
        self.rows = RowBuilder(self.scheduler, self._beams, self.grammars, self.eos_token_ids)
        self.results = StepResults(self.scheduler, self.grammars, self.output, self._beams)
        self.num_steps = 0  # steps that ran something
        self.listeners = Listeners(self.kv)
        self.stats = EngineStats()
        self.add_listener(self.stats)
        spec_config = config.speculative_config
        self.speculation = (
            Speculation(spec_config, max_len, self.grammars) if spec_config is not None else None
        )
        self.kv_events: KVEventPublisher | None = None
        if config.kv_events_endpoint is not None:
            self.kv_events = self._publish_kv_events(
                config.kv_events_endpoint, config.kv_events_keys()
            )

    # --------------------------------------------------------------- requests
    def add_request(
        self,
        request_id: str,
        prompt: str | Seq[int],
        params: SamplingParams | BeamSearchParams | None = None,
        arrival_time: float | None = None,
        grammar: Any = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request; InvalidParameterError if it is malformed or could never fit.

        With BeamSearchParams the request runs a beam search in the engine. `grammar`: the
        compiled grammar of the params' structured output, from `compile_grammar` (the
        async engine compiles it off this thread); compiled here if not given.
        `lora_request`: the LoRA adapter it runs under (None: the base model).
        """
        params = params or SamplingParams()
        adapter = self.loras.check(lora_request) if lora_request is not None else None
        checked = self.checks.check(prompt, params, adapter.pages if adapter else 0)
        spec = params.structured_outputs if isinstance(params, SamplingParams) else None
        if spec is None:
            grammar = None
        elif grammar is None:
            grammar = self.grammars.compile(spec)
        seq = self.scheduler.new_seq(checked.prompt_ids)
        if grammar is not None:
            think = params.think_tokens if isinstance(params, SamplingParams) else None
            self.grammars.add(seq.seq_id, self.grammars.start(grammar), think)
        request = Request(
            request_id=request_id,
            seqs=[seq],
            num_seq_slots=checked.num_seqs,
            reserve_tokens=checked.reserve_tokens,
            params=params,
            arrival_time=time.time() if arrival_time is None else arrival_time,
            prompt=prompt if isinstance(prompt, str) else None,
        )
        if adapter is not None:
            request.lora_id, request.lora_path = adapter.lora_id, adapter.path
            request.lora_pages = adapter.pages
        if self.speculation is not None:
            self.speculation.prepare(request)
        self.scheduler.add_request(request)
        if isinstance(params, BeamSearchParams):
            self._beams[request_id] = BeamState(params, frozenset(self.eos_token_ids))

    def check_request(
        self, prompt: Seq[int], params: SamplingParams | BeamSearchParams | None = None
    ) -> None:
        """InvalidParameterError if add_request would refuse this request for its token
        ids, sequence count, context or KV-pool fit: checks that cost next to nothing, for
        the server to make before it compiles a grammar. Safe from any thread (it reads
        only what the engine's configuration fixes). An adapter is checked by check_lora."""
        self.checks.check(prompt, params or SamplingParams())

    def check_lora(self, lora_request: LoRARequest) -> KnownAdapter:
        """The adapter `lora_request` names, checked: its files against the base model and
        max_lora_rank, its id against the adapters seen before, and its pages against the
        pool (a one-token request under it must fit); InvalidParameterError naming the
        field otherwise. On the engine's thread: the runner reads the files."""
        adapter = self.loras.check(lora_request)
        self.scheduler.check_fits(1, 1, lora_pages=adapter.pages)
        return adapter

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget the adapter `lora_int_id`: requests running under it finish under it, its
        pages return to the pool when the last of them ends, and the id is not taken again.
        False if no such adapter was known."""
        if not self.loras.retire(lora_int_id):
            return False
        if self.kv.adapters is not None:
            self.kv.adapters.drop(lora_int_id)
        self.runner.drop_adapter(lora_int_id)
        return True

    def abort(self, request_id: str) -> bool:
        """Stop a request now; every block it held returns to the pool."""
        req = self.scheduler.abort(request_id)
        if req is None:
            return False
        self._beams.pop(request_id, None)
        self.output.forget(req)
        self.grammars.forget(req.seqs + req.finished_seqs)
        for seq in req.seqs:
            seq.finish_reason = "abort"
        self.listeners.abort(request_id)
        return True

    def compile_grammar(self, spec: StructuredOutputs, param: str | None = None) -> Any:
        """The compiled grammar of `spec`, for add_request; InvalidParameterError naming
        `param` (default `structured_outputs.<kind>`) if it cannot be compiled. Safe from
        any thread: the async engine calls it off the engine's."""
        return self.grammars.compile(spec, param)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.scheduler.requests)

    def unfinished_request_ids(self) -> list[str]:
        return list(self.scheduler.requests)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix, e.g. to time prompts from a cold cache; running
        requests keep their blocks."""
        self.kv.reset_prefix_cache()

    def usage(self) -> KVUsage:
        return self.kv.usage()

    # -------------------------------------------------------------- read side
    def snapshot(self, tables: bool = False, cached_hashes: bool = False) -> EngineSnapshot:
        """The engine's figures now; `tables`: with every running sequence's block table;
        `cached_hashes`: with the hashes of the prefix cache's blocks."""
        spec = self.speculation.counts if self.speculation is not None else (0, 0, 0)
        return take_snapshot(
            self.scheduler, self.kv, self.num_steps, tables, cached_hashes, speculation=spec
        )

    def add_listener(self, listener: StepListener) -> Callable[[], None]:
        """Call `listener` at every step from now on; returns the call that removes it."""
        return self.listeners.add(listener)

    def record_kv(self, sink: Sink, *, text: bool = False, tokenizer: Any = None) -> KVRecorder:
        """A KV recorder (engine/kv_recorder.py) listening from the current state on,
        handing `sink` a record per step; `text`: each block's token text too (with
        `tokenizer`, else the engine's). `close()` it to stop."""
        recorder = KVRecorder(
            self.scheduler,
            self.kv,
            sink,
            self.snapshot,
            tokenizer=(tokenizer or self.tokenizer) if text else None,
            step=self.num_steps,
        )
        recorder.remove = self.add_listener(recorder)
        return recorder

    def kv_snapshot(self, text: bool = False) -> Record:
        """The KV view's whole picture now (pool, tables, requests, figures), with each
        block's token text if `text`."""
        tokenizer = self.tokenizer if text else None
        return engine_snapshot(
            self.scheduler, self.kv, self.snapshot(), self.num_steps, tokenizer=tokenizer
        )

    def shutdown(self) -> None:
        self.grammars.close()
        if self.kv_events is not None:
            self.kv_events.close()
            self.kv_events = None
        self.runner.shutdown()

    def _publish_kv_events(self, endpoint: str, keys: CurveKeys | None) -> KVEventPublisher:
        """Publish the prefix cache's changes (engine/cache_events.py) to `endpoint`, to
        the subscribers `keys` allows (None: to anyone who can connect)."""
        # Imported here: pyzmq and msgspec are loaded only by an engine that publishes.
        from pagedllm.engine.cache_events import CacheEventCollector
        from pagedllm.engine.kv_event_publisher import KVEventPublisher

        publisher = KVEventPublisher(endpoint, keys=keys)
        self.add_listener(CacheEventCollector(self.kv, publisher.publish))
        logger.info(
            "KV events: publishing to %s (%s)",
            publisher.endpoint,
            who_may_subscribe(endpoint, keys),
        )
        return publisher

    # ------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """One iteration: a RequestOutput for every request that gained a token, ended,
        or failed (`error` set) in it, of the kind its params ask for (a FINAL_ONLY
        request has one only when it ends)."""
        self.listeners.step_begin(self.num_steps + 1)
        if self.speculation is not None:
            self.speculation.propose(self.scheduler)
        step = self.scheduler.schedule()
        if step.is_empty:
            return []
        self.num_steps += 1
        rows, failed = self.rows.rows_of(step)
        try:
            sampled = self.runner.execute(step, rows.rows, rows.grammar_bitmask, rows.prompt_rows)
        except Exception as exc:
            return self._forward_failed(step, rows, exc)
        accepted: dict[str, list[int]] = {}
        if self.speculation is not None:
            accepted = self.speculation.accepted(step, rows, sampled)
        self.scheduler.update_from_output(step, accepted)
        # Forked once the prompt's blocks are hashed: the samples inherit the hashes
        # instead of hashing the prompt again each.
        self._fork(rows.forks)
        ran = self.snapshot()
        outputs = self.results.process(sampled, rows, failed)
        outputs.extend(self._fail(req, exc) for req, exc in failed.values())
        if self.speculation is not None:
            self.speculation.keep_proposals(rows, sampled)
        self.listeners.step_end(step, outputs, ran)
        return outputs

    def _forward_failed(
        self, step: SchedulerOutput, rows: StepRows, exc: Exception
    ) -> list[RequestOutput]:
        """The shared forward pass failed: every request of the step fails, once."""
        # Forked even so: the runner may have seeded generators for the samples, and it
        # drops them only for sequences the request held when it ended.
        self._fork(rows.forks)
        logger.exception(
            "the forward pass failed; failing the %d requests of the step", len(step.request_ids)
        )
        outputs = [
            self._fail(req, exc)
            for request_id in step.request_ids
            if (req := self.scheduler.requests.get(request_id)) is not None
        ]
        # The adapters this step was to write may not be in their pages: the next request
        # under one loads it again.
        for load in step.lora_loads:
            self.kv.adapters.evict(load.lora_id)
        self.listeners.step_end(step, outputs, self.snapshot())
        return outputs

    def _fail(self, req: Request, exc: BaseException) -> RequestOutput:
        """Abort `req` (every block back to the pool); its output says why it failed."""
        out = self.results.failed_output(req, exc)
        self.abort(req.request_id)
        return out

    def _fork(self, forks: list[tuple[Request, Sequence, Sequence]]) -> None:
        for req, parent, child in forks:
            self.scheduler.fork(req, parent, child)
