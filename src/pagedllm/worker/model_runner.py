"""TorchModelRunner: the real model runner, one model on one device.

Each step it does the copy-on-write block copies, builds the flat token batch and its
AttentionMetadata, runs the forward, and samples the rows that need a token. It owns
every tensor of the engine: weights, the paged KV pool, the sampler and the random
generators of seeded samples (keyed by sequence id, dropped when the sequence ends).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from pagedllm.attention.backends import select_attention
from pagedllm.attention.metadata import build_attention_metadata
from pagedllm.core.scheduler import SchedulerOutput
from pagedllm.kernels.cpu import KernelUnavailableError, load_cpu_ops
from pagedllm.loader import LoadedModel
from pagedllm.model.layer_ops import CompiledLayerOps, TorchLayerOps
from pagedllm.model.linear import observe_inputs
from pagedllm.model.llama import LlamaForCausalLM
from pagedllm.model.parallel import ParallelContext
from pagedllm.worker.kv_cache import PagedKVCache
from pagedllm.worker.runner import ModelSpec, SampledTokens, SampleRow
from pagedllm.worker.sampler import Sampler

logger = logging.getLogger("pagedllm")
CALIBRATION_TEXT = Path(__file__).parents[1] / "model" / "data" / "calibration.txt"


class TorchModelRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        dtype: str = "float32",
        device: str = "cpu",
        seed: int = 0,
        kv_cache_dtype: str = "auto",
        attention_backend: str = "auto",
        quantization: str | None = None,
        *,
        parallel: ParallelContext | None = None,
    ) -> None:
        """`parallel`: this rank's group when `loaded` holds one tensor-parallel rank's
        share of the model (worker/tp_runner.py); its logits are gathered on rank 0."""
        self.device = torch.device(device)
        self.dtype: torch.dtype = getattr(torch, dtype)
        self.kv_dtype: torch.dtype = (
            self.dtype if kv_cache_dtype == "auto" else getattr(torch, kv_cache_dtype)
        )
        self.model_config = cfg = loaded.config
        self.attention = select_attention(
            attention_backend,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            self.device,
        )
        logger.info(
            "attention backend: %s; KV cache dtype: %s",
            self.attention.name,
            str(self.kv_dtype).removeprefix("torch."),
        )
        ops = self._layer_ops(attention_backend)
        model = LlamaForCausalLM(cfg, self.attention, ops, parallel)
        model.load_weights(loaded.weights)
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        if quantization == "int8":
            self._quantize_int8(loaded.tokenizer)
        self.spec = ModelSpec(
            vocab_size=loaded.config.vocab_size,
            max_position_embeddings=loaded.config.max_position_embeddings,
            eos_token_ids=loaded.config.eos_token_ids,
        )
        self.kv_cache: PagedKVCache | None = None
        self.sampler = Sampler(torch.Generator(device=self.device).manual_seed(seed))
        self._generators: dict[int, torch.Generator] = {}

    def kv_bytes_per_block(self, block_size: int) -> int:
        return block_size * self.model_config.kv_bytes_per_token(self.kv_dtype.itemsize)

    def init_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.kv_cache = PagedKVCache(
            self.model_config, num_blocks, block_size, dtype=self.kv_dtype, device=self.device
        )

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput, rows: Sequence[SampleRow]) -> SampledTokens:
        for seq_id in step.finished_seq_ids:
            self._generators.pop(seq_id, None)
        logits = self.forward(step)
        if not rows:
            return SampledTokens([], [], [], [])
        return self.sampler(logits, rows, [self._generator(r) for r in rows])

    def forward(self, step: SchedulerOutput) -> torch.Tensor:
        """Logits [rows, vocab] for the scheduled sequences with `needs_logits`, in order."""
        cache = self.kv_cache
        if cache is None:
            raise RuntimeError("init_kv_cache must run before the first step")
        cache.copy_blocks(step.blocks_to_copy)
        seqs = step.seqs
        input_ids = torch.tensor(
            list(itertools.chain.from_iterable(s.token_ids for s in seqs)), dtype=torch.long
        ).to(self.device)
        meta = build_attention_metadata(
            start_positions=[s.start_pos for s in seqs],
            query_lens=[len(s.token_ids) for s in seqs],
            block_tables=[s.block_table for s in seqs],
            logits_seq_indices=[i for i, s in enumerate(seqs) if s.needs_logits],
            block_size=cache.block_size,
            device=self.device,
            dtype=self.dtype,
            with_groups=self.attention.needs_groups,
            query_tile=self.attention.query_tile,
        )
        hidden = self.model(input_ids, meta.positions, cache.layers, meta)
        return self.model.compute_logits(hidden[meta.logits_indices])

    @torch.inference_mode()
    def logits_of(self, token_ids: Sequence[int], chunk: int = 512) -> torch.Tensor:
        """Logits [len, vocab] after each token of `token_ids` (teacher forcing), computed
        in chunks through a private paged cache: the engine's pool is not touched. For
        measuring what an option changes (perplexity, logit differences)."""
        block_size = 16
        num_blocks = -(-len(token_ids) // block_size)
        cache = PagedKVCache(
            self.model_config, num_blocks, block_size, dtype=self.kv_dtype, device=self.device
        )
        table = list(range(num_blocks))
        out = []
        for start in range(0, len(token_ids), chunk):
            ids = torch.tensor(token_ids[start : start + chunk], device=self.device)
            meta = build_attention_metadata(
                [start],
                [len(ids)],
                [table],
                [0],
                block_size,
                device=self.device,
                dtype=self.dtype,
                with_groups=self.attention.needs_groups,
                query_tile=self.attention.query_tile,
            )
            hidden = self.model(ids, meta.positions, cache.layers, meta)
            out.append(self.model.compute_logits(hidden))
        return torch.cat(out)

    def _layer_ops(self, attention_backend: str) -> TorchLayerOps:
        """The fused element-wise kernels on a CPU where they build (and unless the whole
        reference path was asked for), else pure torch."""
        if self.device.type != "cpu" or attention_backend == "reference":
            return TorchLayerOps()
        try:
            return CompiledLayerOps(load_cpu_ops())
        except KernelUnavailableError:  # said once already, by the attention backend's choice
            return TorchLayerOps()

    def _quantize_int8(self, tokenizer: Any) -> None:
        """Int8 linear layers, smoothed on the calibration text (when there is a tokenizer
        to read it), through the compiled kernel where it runs."""
        amax = None
        if tokenizer is not None:
            ids = tokenizer.encode(CALIBRATION_TEXT.read_text(encoding="utf-8"))
            amax = observe_inputs(self.model, lambda: self.logits_of(ids))
        else:
            logger.warning("int8 without a tokenizer: no calibration text, no smoothing")
        try:
            ops = load_cpu_ops()
        except KernelUnavailableError as exc:
            logger.warning("int8 linear layers in pure torch (slower): %s", exc)
            ops = None
        self.model.quantize_int8(amax, ops)

    def shutdown(self) -> None:
        self._generators.clear()

    def _generator(self, row: SampleRow) -> torch.Generator | None:
        if row.seed is None:
            return None
        gen = self._generators.get(row.seq_id)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(row.seed)
            self._generators[row.seq_id] = gen
        return gen
