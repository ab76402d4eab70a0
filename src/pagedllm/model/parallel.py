"""ParallelContext: what one tensor-parallel rank's model asks of its process group.

A rank holds a share of the heads, of the MLP's inner columns and of the vocabulary
(model/sharding.py). Its attention output and MLP projections give partial sums that
`all_reduce` adds up over the ranks; its embedding rows cover one slice of the vocabulary,
so a lookup is also a partial sum; its output projection gives one slice of the logits,
gathered on rank 0, the driver, which alone samples. A single-device model has no
context (None) and computes exactly as before.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F


class ParallelContext:
    def __init__(self, group: Any, rank: int, world_size: int, vocab_size: int) -> None:
        """`group`: a torch.distributed process group (gloo or NCCL) of every rank;
        `vocab_size`: the whole vocabulary (each rank's share is padded to the same size)."""
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.vocab_size = vocab_size
        self.comm_seconds = 0.0  # time in collectives: the benches' communication share

    def _wait(self, work: Any) -> None:
        start = time.perf_counter()
        work.wait()
        self.comm_seconds += time.perf_counter() - start

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place."""
        self._wait(self.group.allreduce([x]))
        return x

    def embed(self, input_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Embeddings of `input_ids` from this rank's rows of the table: each id lives on
        one rank, the others contribute zeros, and the sum is the lookup."""
        local = input_ids - self.rank * weight.shape[0]
        outside = (local < 0) | (local >= weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), weight)
        return self.all_reduce(out.masked_fill_(outside[:, None], 0.0))

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        """The logits [rows, vocab] on rank 0; other ranks get their own slice back."""
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        opts = dist.GatherOptions()
        opts.rootRank = 0
        self._wait(self.group.gather([parts] if self.rank == 0 else [], [local], opts))
        if self.rank != 0:
            return local
        return torch.cat(parts, dim=-1)[:, : self.vocab_size]
