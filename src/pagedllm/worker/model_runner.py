"""ModelRunner: turns the scheduler's plain-data step into tensors and runs the model.

It does the step's copy-on-write block copies, builds the flat token batch and its
AttentionMetadata, runs the forward, and returns logits for the rows that need them.
"""

from __future__ import annotations

import itertools

import torch

from pagedllm.attention.metadata import build_attention_metadata
from pagedllm.core.scheduler import SchedulerOutput
from pagedllm.model.llama import LlamaForCausalLM
from pagedllm.worker.kv_cache import PagedKVCache


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: PagedKVCache) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = kv_cache.data.device

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> torch.Tensor:
        """Logits [rows, vocab] for the scheduled sequences with `needs_logits`, in order."""
        self.kv_cache.copy_blocks(step.blocks_to_copy)
        seqs = step.seqs
        input_ids = torch.tensor(
            list(itertools.chain.from_iterable(s.token_ids for s in seqs)), dtype=torch.long
        ).to(self.device)
        meta = build_attention_metadata(
            start_positions=[s.start_pos for s in seqs],
            query_lens=[len(s.token_ids) for s in seqs],
            block_tables=[s.block_table for s in seqs],
            logits_seq_indices=[i for i, s in enumerate(seqs) if s.needs_logits],
            block_size=self.kv_cache.block_size,
            device=self.device,
            dtype=self.kv_cache.data.dtype,
        )
        hidden = self.model(input_ids, meta.positions, self.kv_cache.layers, meta)
        return self.model.compute_logits(hidden[meta.logits_indices])
