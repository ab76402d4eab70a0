"""A tensor-parallel worker: rank r > 0, which serves the driver until told to stop.

It receives a `WorkerInit` (the whole model's config, the runner options, and the
names, shapes and dtypes of its share of the weights), then the weights, builds the same
TorchModelRunner as the driver over its share, and tells the driver whether that worked.
Then it runs what the driver broadcasts: a `Call` of one of its runner's methods (those
in RANK_METHODS: `init_kv_cache` once, `execute` every engine step with no rows to draw,
since the driver alone samples, `logits_of`), until `Stop`.
Any exception ends the process: a rank that cannot follow the driver must not leave the
others waiting in a collective (they fail at once when its connections close).
"""

from __future__ import annotations

import os
import signal
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pagedllm.errors import InvalidParameterError
from pagedllm.loader import LoadedModel
from pagedllm.model.config import ModelConfig
from pagedllm.model.parallel import ParallelContext
from pagedllm.model.sharding import shard_config
from pagedllm.worker.model_runner import TorchModelRunner
from pagedllm.worker.options import RunnerOptions
from pagedllm.worker.tp_group import (
    TensorSpec,
    TPGroup,
    env_group,
    join_spawned,
    launched_by_torchrun,
    threads_per_rank,
)

# The runner methods the driver may have every rank call: each runs the same collectives
# on every rank, so every rank must run it.
RANK_METHODS = frozenset({"execute", "init_kv_cache", "logits_of"})


@dataclass(frozen=True)
class WorkerInit:
    config: ModelConfig  # the whole model's
    options: RunnerOptions  # each rank's runner takes them with its own device
    device_type: str  # "cpu", or "cuda" (each rank on its local GPU)
    shares: list[list[tuple[str, TensorSpec]]]  # per rank: its weights, in sending order
    source: str
    hf_dir: str
    tokenizer: Any = None  # sent only when int8 reads the calibration text


@dataclass(frozen=True)
class Call:
    """Every rank calls `runner.<method>(*args)` (a name in RANK_METHODS)."""

    method: str
    args: tuple[Any, ...]

    def __post_init__(self) -> None:
        check_rank_method(self.method)


def check_rank_method(name: str) -> None:
    """ValueError unless `name` is in RANK_METHODS."""
    if name not in RANK_METHODS:
        allowed = ", ".join(sorted(RANK_METHODS))
        raise ValueError(f"{name!r} is not a rank method; allowed: {allowed}")


@dataclass(frozen=True)
class Stop:
    pass


def build_rank_runner(
    init: WorkerInit,
    group: TPGroup,
    weights: dict[str, torch.Tensor],
    profile_attention: bool = False,
) -> TorchModelRunner:
    """The runner of `group.rank`'s share (the driver builds its own with this too)."""
    cfg, rank, size = init.config, group.rank, group.world_size
    parallel = ParallelContext(group.compute, rank, size, cfg.vocab_size)
    share = shard_config(cfg, rank, size)
    loaded = LoadedModel(share, weights, init.tokenizer, init.source, init.hf_dir)
    device = "cpu" if init.device_type == "cpu" else f"cuda:{group.local_rank}"
    options = init.options.for_rank(device)
    return TorchModelRunner(loaded, options, parallel=parallel, profile_attention=profile_attention)


def describe(exc: BaseException) -> tuple[str, str | None, str]:
    """A start-up error as plain data for the driver: type name, parameter, message."""
    return type(exc).__name__, getattr(exc, "param", None), str(exc)


def serve(group: TPGroup) -> int:
    """Build this rank's runner, then follow the driver; the process's exit code."""
    init = group.receive()
    if isinstance(init, Stop):  # the driver gave up before start-up
        return 0
    names = [name for name, _ in init.shares[group.rank]]
    tensors = group.receive_tensors(0, [spec for _, spec in init.shares[group.rank]])
    try:
        runner = build_rank_runner(init, group, dict(zip(names, tensors, strict=True)))
    except Exception as exc:
        group.send_object(0, describe(exc))
        raise
    group.send_object(0, None)
    del tensors
    while True:
        msg = group.receive()
        if isinstance(msg, Stop):
            return 0
        if not isinstance(msg, Call):
            raise TypeError(f"unknown message from the driver: {msg!r}")
        check_rank_method(msg.method)  # again: unpickling does not run __post_init__
        getattr(runner, msg.method)(*msg.args)


def _exit_after(start: Callable[[], TPGroup]) -> None:
    """Run a worker to its end and leave the process with its code. os._exit: a group
    whose peer failed must not run its teardown (gloo aborts there)."""
    try:
        code = serve(start())
    except BaseException:
        print(f"pagedllm tensor-parallel worker (pid {os.getpid()}):", file=sys.stderr)
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def spawned_main(rank: int, world_size: int, port: int, backend: str, threads: int) -> None:
    """The entry point of a worker the engine spawned (worker/tp_group.spawn_group)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle
    torch.set_num_threads(threads)
    _exit_after(lambda: join_spawned(rank, world_size, port, backend))


def serve_if_worker_rank(backend: str) -> None:
    """Under a launcher (torchrun), a rank other than 0 serves the driver here, then the
    process exits: `pagedllm generate|serve --tensor-parallel-size N` run on every rank,
    rank 0 drives, the others serve. Returns at once on the driver or without a launcher."""
    if not launched_by_torchrun() or int(os.environ["RANK"]) == 0:
        return
    if backend == "gloo":
        local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
        torch.set_num_threads(threads_per_rank(local))
    _exit_after(lambda: env_group(backend))


def start_error(rank: int, status: tuple[str, str | None, str]) -> Exception:
    """The driver's exception for a worker's start-up failure."""
    kind, param, message = status
    if param is not None:
        return InvalidParameterError(param, f"tensor-parallel rank {rank}: {message}")
    return RuntimeError(f"tensor-parallel rank {rank} failed to start: {kind}: {message}")
