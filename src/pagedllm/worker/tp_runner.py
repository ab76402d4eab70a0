"""TensorParallelRunner: the model split over N ranks, behind the one ModelRunner interface.

The driver (rank 0, this process) holds the engine, its one scheduler and all the block
bookkeeping; every step it broadcasts the plain-data SchedulerOutput to the workers,
then runs its own share of the forward through a TorchModelRunner, whose sampler and
seeded generators are the single-device runner's own: the logits it samples are the
whole vocabulary's, gathered on rank 0. Each rank's KV pool holds its heads' share of
every block, so the block tables are the driver's as they are: the step carries only
their changes, and each rank's runner keeps its own copy (worker/input_batch.py), so a
step's message does not grow with the contexts.

Workers are spawned here (one machine) or were started by a launcher (torchrun, env://);
see worker/tp_group.py for how ranks meet and the timeouts that keep anything from
waiting forever. A worker that dies, or any failure in a step, takes the whole group
down: the step raises (the engine fails its requests), the other workers are stopped,
and every later step raises at once.
"""

from __future__ import annotations

import atexit
import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.errors import InvalidParameterError, TensorParallelError
from pagedllm.loader import LoadedModel
from pagedllm.model.sharding import check_tensor_parallel, shard_weights
from pagedllm.worker.model_runner import TorchModelRunner
from pagedllm.worker.options import RunnerOptions
from pagedllm.worker.runner import ModelSpec, PromptLogprobsRow, SampledTokens, SampleRow
from pagedllm.worker.tp_group import (
    TPGroup,
    env_group,
    launched_by_torchrun,
    spawn_group,
    threads_per_rank,
)
from pagedllm.worker.tp_worker import (
    Call,
    Stop,
    WorkerInit,
    build_rank_runner,
    spawned_main,
    start_error,
)

logger = logging.getLogger("pagedllm")
T = TypeVar("T")
STOP_SECONDS = 10.0  # how long workers get to leave after Stop before they are terminated


def backend_for(device: str, size: int) -> str:
    """gloo on CPUs, NCCL on GPUs; InvalidParameterError when this machine has neither."""
    if device == "cpu":
        if not (dist.is_available() and dist.is_gloo_available()):
            raise InvalidParameterError(
                "tensor_parallel_size", "tensor parallelism on CPUs needs torch.distributed (gloo)"
            )
        return "gloo"
    if not (torch.cuda.is_available() and dist.is_available() and dist.is_nccl_available()):
        raise InvalidParameterError(
            "tensor_parallel_size", "tensor parallelism on CUDA needs a torch build with NCCL"
        )
    if not launched_by_torchrun() and torch.cuda.device_count() < size:
        raise InvalidParameterError(
            "tensor_parallel_size",
            f"tensor_parallel_size={size} needs {size} GPUs; {torch.cuda.device_count()} found",
        )
    return "nccl"


class TensorParallelRunner:
    def __init__(
        self, options: RunnerOptions, loaded: LoadedModel, *, profile_attention: bool = False
    ) -> None:
        """`options`: every rank's (each on its own device); `profile_attention`: the
        driver's runner adds up the seconds its attention takes."""
        size = options.tensor_parallel_size
        check_tensor_parallel(loaded.config, size)
        backend = backend_for(options.device, size)
        cfg = loaded.config
        self.spec = ModelSpec(
            cfg.vocab_size,
            cfg.max_position_embeddings,
            cfg.eos_token_ids,
            num_layers=cfg.num_hidden_layers,
            layer_windows=cfg.layer_windows,
        )
        self._threads = torch.get_num_threads()
        self._failure: str | None = None
        self.group: TPGroup
        if launched_by_torchrun():
            self.group = env_group(backend)
        else:
            threads = threads_per_rank(size)
            self.group = spawn_group(size, backend, spawned_main, threads)
        if backend == "gloo":
            torch.set_num_threads(threads_per_rank(self.group.local_world_size))
        try:
            if self.group.world_size != size:
                raise InvalidParameterError(
                    "tensor_parallel_size",
                    f"tensor_parallel_size={size}, but the launcher started "
                    f"{self.group.world_size} ranks (WORLD_SIZE)",
                )
            self.local = self._start(options, loaded, profile_attention)
        except BaseException:
            # Ranks may be anywhere in start-up (waiting to report, building, calibrating):
            # end them rather than wait for them.
            self._close(stop=False)
            raise
        self.parallel = self.local.model.parallel
        atexit.register(self.shutdown)  # a launcher's workers wait for Stop to exit cleanly
        logger.info("tensor parallel: %d ranks over %s", size, backend)

    def _start(
        self, options: RunnerOptions, loaded: LoadedModel, profile_attention: bool
    ) -> TorchModelRunner:
        group, size = self.group, self.group.world_size
        shares = [shard_weights(loaded.weights, loaded.config, r, size) for r in range(size)]
        init = WorkerInit(
            config=loaded.config,
            options=options,
            device_type="cpu" if options.device == "cpu" else "cuda",
            shares=[
                [(n, (tuple(t.shape), str(t.dtype).removeprefix("torch."))) for n, t in s.items()]
                for s in shares
            ],
            source=loaded.source,
            hf_dir=loaded.hf_dir,
            tokenizer=loaded.tokenizer if options.quantization == "int8" else None,
        )
        group.broadcast(init)
        for rank in range(1, size):
            group.send_tensors(rank, list(shares[rank].values()))
            shares[rank] = {}  # sent: free the copies
        local = build_rank_runner(init, group, shares[0], profile_attention)
        for rank in range(1, size):
            status = group.receive_object(rank)
            if status is not None:
                raise start_error(rank, status)
        return local

    # ------------------------------------------------------------- the interface
    @property
    def model(self) -> Any:
        """The driver's share of the model (rank 0's heads)."""
        return self.local.model

    @property
    def attention(self) -> Any:
        return self.local.attention

    @property
    def comm_seconds(self) -> float:
        """Seconds the driver has spent in the model's collectives."""
        return self.local.comm_seconds

    @property
    def attention_seconds(self) -> float | None:
        """The driver's seconds in attention, with `profile_attention`; else None."""
        return self.local.attention_seconds

    def kv_bytes_per_block(self, block_size: int) -> int:
        """Bytes of one block on each rank (its KV heads' share)."""
        return self.local.kv_bytes_per_block(block_size)

    def init_kv_cache(
        self,
        num_blocks: int,
        block_size: int,
        layer_groups: tuple[tuple[int, ...], ...] | None = None,
        null_block: bool = False,
    ) -> None:
        self._call("init_kv_cache", num_blocks, block_size, layer_groups, null_block)

    def execute(
        self,
        step: SchedulerOutput,
        rows: Sequence[SampleRow],
        grammar_bitmask: Any = None,
        prompt_rows: Sequence[PromptLogprobsRow] = (),
    ) -> SampledTokens:
        # The workers draw no rows: the driver alone samples, from the gathered logits.
        # They compute the prompt rows' logits too, for the gathers to pair up.
        worker_args = (step, (), None, prompt_rows)
        return self._call(
            "execute", step, rows, grammar_bitmask, prompt_rows, worker_args=worker_args
        )

    @property
    def int8_kernels(self) -> dict[str, str]:
        """Empty: the ranks hold the layers (each logs its int8 kernel choice)."""
        return {}

    def logits_of(self, token_ids: Sequence[int], chunk: int = 512) -> torch.Tensor:
        """Teacher-forced logits [len, vocab], as TorchModelRunner.logits_of (every rank
        runs the same chunks: their collectives must pair up)."""
        return self._call("logits_of", list(token_ids), chunk)

    def _no_lora(self) -> InvalidParameterError:
        return InvalidParameterError(
            "enable_lora",
            "LoRA adapters run on one device, not with tensor_parallel_size "
            f"{self.group.world_size}",
        )

    def adapter_pages(self, lora_path: str, block_size: int) -> int:
        raise self._no_lora()

    def max_adapter_pages(self, block_size: int) -> int:
        raise self._no_lora()

    def drop_adapter(self, lora_id: int) -> None:
        pass  # no adapter was ever loaded

    def shutdown(self) -> None:
        if self.group.closed:
            return
        atexit.unregister(self.shutdown)
        self._close(stop=self._failure is None)
        self.local.shutdown()

    # ------------------------------------------------------------------- helpers
    def _call(self, method: str, *args: Any, worker_args: tuple[Any, ...] | None = None) -> Any:
        """Every rank calls its runner's `method` (one of RANK_METHODS): the driver with
        `args`, the workers with `worker_args` when given, else the same `args`."""
        message = Call(method, args if worker_args is None else worker_args)
        return self._run(message, lambda: getattr(self.local, method)(*args))

    def _run(self, message: Any, local: Callable[[], T]) -> T:
        """Every rank does `message`'s work; the driver's part is `local()`."""
        if self._failure is not None:
            raise TensorParallelError(self._failure)
        try:
            dead = self.group.dead_workers()
            if dead:
                raise TensorParallelError("; ".join(dead))
            self.group.broadcast(message)
            return local()
        except Exception as exc:
            # Ranks may now be out of step: no later step can be trusted. The workers
            # still alive fail their collectives too and leave; close() ends the rest.
            self._close(stop=False)
            dead = self.group.dead_workers()
            self._failure = "the tensor-parallel group failed (" + (
                "; ".join(dead) if dead else f"{type(exc).__name__}: {exc}"
            )
            self._failure += "); this engine cannot run more steps"
            raise TensorParallelError(self._failure) from exc

    def _close(self, stop: bool) -> None:
        """Stop the workers (by message when the group is sound, else by signal) and
        give the driver's cores back."""
        if stop and not self.group.closed:
            try:
                self.group.broadcast(Stop())
            except Exception:  # a worker already gone: close() ends the rest
                logger.warning("tensor parallel: could not tell every worker to stop")
        self.group.close(wait=STOP_SECONDS if stop else 1.0)
        torch.set_num_threads(self._threads)
