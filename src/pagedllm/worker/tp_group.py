"""The process group of a tensor-parallel engine: how its ranks meet, talk and part.

Ranks meet in one of two ways. The engine spawns ranks 1..N-1 on this machine
(torch.multiprocessing, spawn), which join a TCPStore it hosts on a free loopback port;
or a launcher (torchrun) started every rank with RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set, and they meet through env:// rendezvous. Rank 0 is the driver.

Each engine opens its own three groups (no global default group, so that engines do not
share state and a process may hold several in turn):
* `messages` (gloo): the driver's broadcasts, one per step. Workers wait on it for as long
  as the driver is idle (a server may idle for days), so their timeout is a year; a driver
  that dies closes its sockets and the wait fails at once. A gloo send completes only once
  the receiver is there, so the driver's side has COLLECTIVE_TIMEOUT: a worker that hangs
  between steps fails the next step instead of blocking it.
* `sync` (gloo): start-up (weights, each rank's status), within START_TIMEOUT: a first
  build of the CPU kernels may take minutes.
* `compute`: the model's collectives, gloo on CPUs and NCCL on GPUs, within
  COLLECTIVE_TIMEOUT. A rank that dies fails the others' collectives at once (its
  connections close); one that hangs fails them after the timeout.
"""

from __future__ import annotations

import os
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

START_TIMEOUT = timedelta(minutes=10)
COLLECTIVE_TIMEOUT = timedelta(minutes=5)
IDLE_TIMEOUT = timedelta(days=365)
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
TensorSpec = tuple[tuple[int, ...], str]  # shape, torch dtype name


def launched_by_torchrun() -> bool:
    """Whether a launcher started this process as one rank of a group (env://)."""
    return all(v in os.environ for v in _LAUNCHER_VARS)


def threads_per_rank(ranks_here: int) -> int:
    """Each rank on this machine gets an equal share of its cores: ranks that each want
    every core would only take turns."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // ranks_here)


def _pickled(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


def _exited(procs: list[BaseProcess]) -> list[str]:
    return [f"{p.name} exited with code {p.exitcode}" for p in procs if p.exitcode is not None]


@dataclass
class TPGroup:
    rank: int
    world_size: int
    local_rank: int  # which GPU of this machine is the rank's
    local_world_size: int  # ranks on this machine
    store: Any  # kept alive: NCCL meets through it at its first collective
    messages: Any
    sync: Any
    compute: Any
    procs: list[BaseProcess] = field(default_factory=list)  # spawned workers (driver only)

    # ---------------------------------------------------------------- driver -> all
    def _broadcast(self, tensor: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.messages.broadcast([tensor], opts).wait()

    def broadcast(self, obj: Any) -> None:
        """Send a picklable message to every worker (driver only)."""
        data = _pickled(obj)
        self._broadcast(torch.tensor([data.numel()]))
        self._broadcast(data)

    def receive(self) -> Any:
        """The driver's next message (workers only); waits as long as the driver idles."""
        size = torch.zeros(1, dtype=torch.long)
        self._broadcast(size)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        self._broadcast(data)
        return pickle.loads(data.numpy().tobytes())

    # ------------------------------------------------------------ point to point
    def send_tensors(self, dst: int, tensors: list[torch.Tensor]) -> None:
        works = [self.sync.send([t.contiguous()], dst, 0) for t in tensors]
        for work in works:
            work.wait()

    def receive_tensors(self, src: int, specs: list[TensorSpec]) -> list[torch.Tensor]:
        """Tensors of the given (shape, dtype) from rank `src`, in the order sent."""
        out = [torch.empty(shape, dtype=getattr(torch, dtype)) for shape, dtype in specs]
        for work in [self.sync.recv([t], src, 0) for t in out]:
            work.wait()
        return out

    def send_object(self, dst: int, obj: Any) -> None:
        data = _pickled(obj)
        self.send_tensors(dst, [torch.tensor([data.numel()]), data])

    def receive_object(self, src: int) -> Any:
        (size,) = self.receive_tensors(src, [((1,), "int64")])
        (data,) = self.receive_tensors(src, [((int(size.item()),), "uint8")])
        return pickle.loads(data.numpy().tobytes())

    # ------------------------------------------------------------------ lifetime
    def dead_workers(self) -> list[str]:
        """The spawned workers that have exited, with their exit codes."""
        return _exited(self.procs)

    @property
    def closed(self) -> bool:
        return self.messages is None

    def close(self, wait: float) -> None:
        """Give the spawned workers `wait` seconds to leave (after a Stop they do, and
        after a failed collective too), end those still there, and drop the groups."""
        deadline = time.monotonic() + wait
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self.messages = self.sync = self.compute = self.store = None


def _open(store: Any, rank: int, world_size: int, local: tuple[int, int], backend: str) -> TPGroup:
    def gloo(name: str, timeout: timedelta) -> Any:
        return dist.ProcessGroupGloo(dist.PrefixStore(name, store), rank, world_size, timeout)

    # Timeouts are each rank's own: the workers wait for the driver without end.
    messages = gloo("messages", COLLECTIVE_TIMEOUT if rank == 0 else IDLE_TIMEOUT)
    sync = gloo("sync", START_TIMEOUT)
    if backend == "nccl":
        torch.cuda.set_device(local[0])
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = COLLECTIVE_TIMEOUT
        compute = dist.ProcessGroupNCCL(dist.PrefixStore("compute", store), rank, world_size, opts)
    else:
        compute = gloo("compute", COLLECTIVE_TIMEOUT)
    return TPGroup(rank, world_size, *local, store, messages, sync, compute)


def spawn_group(
    world_size: int, backend: str, target: Callable[..., None], threads: int
) -> TPGroup:
    """The driver's group over ranks 1..N-1 spawned here: `target(rank, world_size, port,
    backend, threads)` runs in each (it calls `join_spawned`)."""
    store = dist.TCPStore(
        "127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False, timeout=START_TIMEOUT
    )
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(
            target=target,
            args=(rank, world_size, store.port, backend, threads),
            name=f"pagedllm-tp-rank{rank}",
            daemon=True,  # never outlive the engine's process
        )
        for rank in range(1, world_size)
    ]
    for proc in procs:
        proc.start()
    group = None
    try:
        # Meet only once every worker is up: a worker that fails to start (an import
        # error, no memory) is seen here at once, not after a rendezvous timeout.
        deadline = time.monotonic() + START_TIMEOUT.total_seconds()
        keys = [f"up/{rank}" for rank in range(1, world_size)]
        while not store.check(keys):
            dead = _exited(procs)
            if dead or time.monotonic() > deadline:
                raise RuntimeError(
                    "tensor-parallel workers failed to start: "
                    + ("; ".join(dead) or f"none up after {START_TIMEOUT}")
                )
            time.sleep(0.05)
        group = _open(store, 0, world_size, (0, world_size), backend)
        group.procs = procs
        return group
    finally:
        if group is None:
            for proc in procs:
                proc.kill()
                proc.join()


def join_spawned(rank: int, world_size: int, port: int, backend: str) -> TPGroup:
    """A spawned worker's side of `spawn_group`."""
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=START_TIMEOUT)
    store.set(f"up/{rank}", "1")
    return _open(store, rank, world_size, (rank, world_size), backend)


def env_group(backend: str) -> TPGroup:
    """This rank's group under a launcher (env:// rendezvous: RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT; LOCAL_RANK and LOCAL_WORLD_SIZE when set, as torchrun does)."""
    store, rank, world_size = next(dist.rendezvous("env://", timeout=START_TIMEOUT))
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    return _open(store, rank, world_size, (local_rank, local_size), backend)
