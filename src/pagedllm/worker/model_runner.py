"""TorchModelRunner: the real model runner, one model on one device.

Each step it does the copy-on-write block copies, brings its persistent batch of block
tables up to date with the step's changes (worker/input_batch.py), builds the flat token
batch and its AttentionMetadata, runs the forward, and samples the rows that need a token. It owns
every tensor of the engine: weights, the paged KV pool, the sampler, the random
generators of seeded samples (keyed by sequence id, dropped when the sequence ends) and
the token counts of sequences with penalties (worker/penalty_rows.py: built once from
the ids a row carries, then counting each step's kept tokens).
It computes as its RunnerOptions say (worker/options.py), never reading the engine's
configuration. With a draft model (worker/draft_model.py) it checks the proposals the
draft drew after the last step against the draft's distributions, and after drawing the
step's tokens has the draft propose the next step's. The prompt positions a request
scores (SamplingParams.prompt_logprobs) are scored from the same forward
(worker/prompt_scoring.py).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from pagedllm.attention.backends import AttentionBackend, select_attention
from pagedllm.attention.metadata import build_grouped_metadata
from pagedllm.attention.timed import TimedAttention
from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.errors import InvalidParameterError, KernelUnavailableError
from pagedllm.kernels.cpu import load_cpu_ops
from pagedllm.kernels.int8_choice import isa_name
from pagedllm.loader import LoadedModel
from pagedllm.model.layer_ops import CompiledLayerOps, TorchLayerOps
from pagedllm.model.linear import Int8Linear, choose_int8_gemm, observe_inputs
from pagedllm.model.linear_deltas import LinearDeltas
from pagedllm.model.llama import LlamaForCausalLM
from pagedllm.model.parallel import ParallelContext
from pagedllm.worker.draft_model import DraftProposer
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.kv_cache import PagedKVCache
from pagedllm.worker.lora_step import RunnerLoRA
from pagedllm.worker.options import RunnerOptions
from pagedllm.worker.penalty_rows import PenaltyRows
from pagedllm.worker.prompt_scoring import score_prompts
from pagedllm.worker.runner import (
    ModelSpec,
    PromptLogprobs,
    PromptLogprobsRow,
    SampledTokens,
    SampleRow,
)
from pagedllm.worker.sampler import Sampler
from pagedllm.worker.spec_sampling import draw_with_proposals
from pagedllm.worker.spec_verify import SpecVerifier
from pagedllm.worker.token_counts import TensorCountStore

logger = logging.getLogger("pagedllm")
CALIBRATION_TEXT = Path(__file__).parents[1] / "model" / "data" / "calibration.txt"
# Block size of the private cache of `logits_of`: any size gives the same logits; this is
# the engine's default.
SCRATCH_BLOCK_SIZE = 16


class TorchModelRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        options: RunnerOptions | None = None,
        *,
        parallel: ParallelContext | None = None,
        profile_attention: bool = False,
        draft: TorchModelRunner | None = None,
    ) -> None:
        """`options`: how to compute (default: RunnerOptions()). `parallel`: this rank's
        group when `loaded` holds one tensor-parallel rank's share of the model
        (worker/tp_runner.py); its logits are gathered on rank 0. `profile_attention`:
        add up the seconds spent in attention (`attention_seconds`), for the benches.
        `draft`: the draft model's runner, which then proposes the speculating rows'
        tokens (its vocabulary must be this model's)."""
        options = options if options is not None else RunnerOptions()
        self.options = options
        self.device = torch.device(options.device)
        self.dtype: torch.dtype = getattr(torch, options.dtype)
        kv_dtype = options.kv_cache_dtype
        self.kv_dtype: torch.dtype = self.dtype if kv_dtype == "auto" else getattr(torch, kv_dtype)
        self.model_config = cfg = loaded.config
        attention: AttentionBackend = select_attention(
            options.attention_backend,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            self.device,
            cfg.attention_scale,
        )
        self._timed = TimedAttention(attention) if profile_attention else None
        self.attention: AttentionBackend = self._timed or attention
        logger.info(
            "attention backend: %s; KV cache dtype: %s",
            self.attention.name,
            str(self.kv_dtype).removeprefix("torch."),
        )
        ops = self._layer_ops(options.attention_backend)
        if options.quantization == "auto":
            raise ValueError("quantization 'auto' is decided before a runner is built")
        gguf = options.quantization == "gguf"
        if gguf != loaded.kept_quantized:
            raise ValueError(
                "quantization='gguf' and a GGUF loaded with its blocks kept go together"
            )
        kernels = self._gguf_kernels() if gguf else None
        linear = "gguf" if gguf else "dense"
        model = LlamaForCausalLM(cfg, self.attention, ops, parallel, linear, kernels)
        model.load_weights(loaded.weights)
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        if options.quantization == "int8":
            self._quantize_int8(loaded.tokenizer)
        self.spec = ModelSpec(
            vocab_size=loaded.config.vocab_size,
            max_position_embeddings=loaded.config.max_position_embeddings,
            eos_token_ids=loaded.config.eos_token_ids,
            num_layers=cfg.num_hidden_layers,
            layer_windows=cfg.layer_windows,
        )
        self.kv_cache: PagedKVCache | None = None
        self.input_batch: InputBatch | None = None
        kernels = ops.ops if isinstance(ops, CompiledLayerOps) else None
        generator = torch.Generator(device=self.device).manual_seed(options.seed)
        self.sampler = Sampler(generator, kernels)
        # Speculating rows draw their unseeded noise from the sampler's generator too.
        self.verifier = SpecVerifier(self.sampler.generator)
        self._generators: dict[int, torch.Generator] = {}
        # The sampled logits are the whole vocabulary's, also on a rank holding a share.
        vocab = parallel.vocab_size if parallel is not None else cfg.vocab_size
        self.count_store = TensorCountStore(vocab, self.device)
        self.penalties = PenaltyRows(self.count_store)
        # LoRA adapters: rows run under their adapter, whose weights sit in pool pages. A
        # draft model proposes from its base weights (its proposals are checked under the
        # adapter, so the output is the adapter's; only the acceptance rate may drop).
        self.lora: RunnerLoRA | None = None
        if options.enable_lora:
            self.lora = RunnerLoRA(
                cfg,
                options.max_lora_rank,
                options.max_cpu_loras,
                self.kv_dtype.itemsize,
                self.device,
            )
        self.draft: DraftProposer | None = None
        if draft is not None:
            self._attach_draft(draft)

    def _attach_draft(self, draft: TorchModelRunner) -> None:
        got, want = draft.model_config.vocab_size, self.model_config.vocab_size
        if got != want:
            raise InvalidParameterError(
                "speculative_model",
                f"the draft model's vocabulary ({got} tokens) must be the target's ({want}): "
                "a draft needs the same tokenizer",
            )
        # Proposals draw their unseeded noise from the sampler's generator too.
        self.draft = DraftProposer(draft, self.sampler.generator)
        # Proposals sit at positions the target checks: both models must reach them.
        positions = min(self.spec.max_position_embeddings, self.draft.max_position_embeddings)
        self.spec = replace(self.spec, max_position_embeddings=positions)

    @property
    def attention_seconds(self) -> float | None:
        """Seconds spent in attention so far, with `profile_attention`; else None."""
        return None if self._timed is None else self._timed.seconds

    @property
    def comm_seconds(self) -> float:
        """Seconds spent in tensor-parallel collectives (0 on a single device)."""
        parallel = self.model.parallel
        return 0.0 if parallel is None else parallel.comm_seconds

    @property
    def int8_kernels(self) -> dict[str, str]:
        """The int8 kernels each kind of linear layer runs ("qkv": "gemm avx2 panels up to
        2 rows, gemv avx2 up to 8, gemm avx2 above", ...) and "isa", the instruction set;
        empty without int8."""
        kinds: dict[str, str] = {}
        for name, module in self.model.named_modules():
            if isinstance(module, Int8Linear):
                kinds.setdefault(name.rsplit(".", 1)[-1], module.kernels)
                if module.ops is not None:
                    kinds.setdefault("isa", isa_name(module.ops.int8_has_vnni()[1]))
        return kinds

    def kv_bytes_per_block(self, block_size: int) -> int:
        """A block's bytes: the model's K/V of `block_size` tokens, plus the draft's."""
        own = block_size * self.model_config.kv_bytes_per_token(self.kv_dtype.itemsize)
        return own + (self.draft.kv_bytes_per_block(block_size) if self.draft else 0)

    def init_kv_cache(
        self,
        num_blocks: int,
        block_size: int,
        layer_groups: tuple[tuple[int, ...], ...] | None = None,
        null_block: bool = False,
    ) -> None:
        if self.lora is not None and layer_groups is not None and len(layer_groups) > 1:
            raise InvalidParameterError(
                "enable_lora",
                "LoRA adapters take pages of a pool of one layer group: add "
                "disable_hybrid_kv_cache_manager (--disable-hybrid-kv-cache-manager) for this "
                f"model's {len(layer_groups)} layer groups",
            )
        if self.draft is not None:
            if layer_groups is not None and len(layer_groups) > 1:
                raise InvalidParameterError(
                    "speculative_model",
                    "a draft model shares the target's block tables, which needs every layer "
                    "allocated as full attention: add disable_hybrid_kv_cache_manager "
                    f"(--disable-hybrid-kv-cache-manager) for this model's {len(layer_groups)} "
                    "layer groups",
                )
            self.draft.init_kv_cache(num_blocks, block_size)
            draft_bytes = self.draft.kv_bytes_per_block(block_size)
            logger.info(
                "KV pool with a draft model: each block holds %d bytes of the target's K/V and "
                "%d of the draft's (same block ids, a second set of K/V tensors)",
                self.kv_bytes_per_block(block_size) - draft_bytes,
                draft_bytes,
            )
        self.kv_cache = PagedKVCache(
            self.model_config,
            num_blocks,
            block_size,
            dtype=self.kv_dtype,
            device=self.device,
            layer_groups=layer_groups,
            null_block=null_block,
        )
        self.input_batch = InputBatch(max(self.kv_cache.layer_group) + 1)

    @torch.inference_mode()
    def execute(
        self,
        step: SchedulerOutput,
        rows: Sequence[SampleRow],
        grammar_bitmask: Any = None,
        prompt_rows: Sequence[PromptLogprobsRow] = (),
    ) -> SampledTokens:
        for seq_id in step.finished_seq_ids:
            self._generators.pop(seq_id, None)
        if self.input_batch is None:
            raise RuntimeError("init_kv_cache must run before the first step")
        tables = self.input_batch.step_tables(step)
        count_rows = self.penalties.apply(step, rows)
        penalised = any(r.params.has_penalties for r in rows)
        counts = self.count_store.gather(count_rows) if penalised else None
        gens = [self._generator(r) for r in rows]
        draft_probs = self.draft.draft_probs(rows) if self.draft is not None else None
        logits, prompt_logprobs = self.forward(step, tables, prompt_rows)
        sampled = SampledTokens([], [], [], [])
        if rows:
            sampled = draw_with_proposals(
                self.sampler,
                self.verifier,
                logits,
                rows,
                gens,
                draft_probs,
                grammar_bitmask,
                counts,
            )
        self.penalties.add(rows, sampled)
        if prompt_logprobs:
            sampled = replace(sampled, prompt_logprobs=prompt_logprobs)
        if self.draft is not None:
            proposals = self.draft.propose(
                step,
                rows,
                sampled,
                gens,
                tables,
                self.input_batch.mirror.table_len,
                self.count_store.gather(count_rows) if penalised else None,
            )
            sampled = replace(sampled, next_proposals=proposals)
        return sampled

    def forward(
        self,
        step: SchedulerOutput,
        tables: Sequence[torch.Tensor],
        prompt_rows: Sequence[PromptLogprobsRow] = (),
    ) -> tuple[torch.Tensor, list[PromptLogprobs]]:
        """Logits [rows, vocab] for the scheduled sequences with `needs_logits`, in order:
        one row each, or k+1 (its last token's and each proposal's) for a sequence that
        checks k proposed tokens; and the answers to `prompt_rows`. `tables`: the
        sequences' block tables per layer group (InputBatch.step_tables)."""
        cache = self.kv_cache
        if cache is None:
            raise RuntimeError("init_kv_cache must run before the first step")
        cache.copy_blocks(step.blocks_to_copy)
        seqs = step.seqs
        query_lens = [len(s.token_ids) for s in seqs]
        deltas = self.lora.step_deltas(step, cache, query_lens) if self.lora is not None else None
        hidden, rows = self.run_tokens(
            cache,
            list(itertools.chain.from_iterable(s.token_ids for s in seqs)),
            start_positions=[s.start_pos for s in seqs],
            query_lens=query_lens,
            block_tables=tables,
            logits_seq_indices=[i for i, s in enumerate(seqs) if s.needs_logits],
            deltas=deltas,
        )
        scored = score_prompts(self.model, hidden, query_lens, prompt_rows) if prompt_rows else []
        counts = [s.num_logits_rows for s in seqs if s.needs_logits]
        if any(c > 1 for c in counts):  # a sequence's k+1 rows end at its last row
            last = rows.tolist()
            spread = [
                r for end, c in zip(last, counts, strict=True) for r in range(end - c + 1, end + 1)
            ]
            rows = torch.tensor(spread, dtype=torch.long, device=hidden.device)
        return self.model.compute_logits(hidden[rows]), scored

    @torch.inference_mode()
    def logits_of(self, token_ids: Sequence[int], chunk: int = 512) -> torch.Tensor:
        """Logits [len, vocab] after each token of `token_ids` (teacher forcing), computed
        in chunks through a private paged cache: the engine's pool is not touched. For
        measuring what an option changes (perplexity, logit differences)."""
        num_blocks = -(-len(token_ids) // SCRATCH_BLOCK_SIZE)
        cache = PagedKVCache(
            self.model_config, num_blocks, SCRATCH_BLOCK_SIZE, self.kv_dtype, self.device
        )
        tables = [torch.arange(num_blocks)[None]]  # one group: every layer allocated in full
        out = []
        for start in range(0, len(token_ids), chunk):
            ids = list(token_ids[start : start + chunk])
            hidden, _ = self.run_tokens(cache, ids, [start], [len(ids)], tables, [0])
            out.append(self.model.compute_logits(hidden))  # every row's, not just the last
        return torch.cat(out)

    def run_tokens(
        self,
        cache: PagedKVCache,
        token_ids: list[int],
        start_positions: Sequence[int],
        query_lens: Sequence[int],
        block_tables: Sequence[torch.Tensor],
        logits_seq_indices: Sequence[int],
        deltas: LinearDeltas | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward of a flat batch through `cache`: the final hidden states, and the
        rows of the sequences whose logits are asked for. `block_tables[g]`: the host
        tensor [sequences, entries] of the sequences' tables of the cache's layer group g;
        `deltas`: the rows' LoRA adapters (None: the base for every row)."""
        meta = build_grouped_metadata(
            start_positions,
            query_lens,
            block_tables,
            logits_seq_indices,
            cache.block_size,
            cache.layer_group,
            device=self.device,
            dtype=self.dtype,
        )
        input_ids = torch.tensor(token_ids, dtype=torch.long).to(self.device)
        hidden = self.model(input_ids, meta.positions, cache.layers, meta, deltas)
        return hidden, meta.logits_indices

    def _layer_ops(self, attention_backend: str) -> TorchLayerOps:
        """The fused element-wise kernels on a CPU where they build (and unless the whole
        reference path was asked for), else pure torch."""
        if self.device.type != "cpu" or attention_backend == "reference":
            return TorchLayerOps()
        try:
            return CompiledLayerOps(load_cpu_ops())
        except KernelUnavailableError:  # said once already, by the attention backend's choice
            return TorchLayerOps()

    def _gguf_kernels(self) -> Any:
        """The compiled kernels GGUF linear layers call, or None: pure torch."""
        try:
            return load_cpu_ops()
        except KernelUnavailableError as exc:
            logger.warning("GGUF linear layers in pure torch (much slower): %s", exc)
            return None

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
        if ops is not None:
            choose_int8_gemm(self.model, ops)

    def _lora(self) -> RunnerLoRA:
        if self.lora is None:
            raise InvalidParameterError(
                "enable_lora", "LoRA adapters need enable_lora (--enable-lora)"
            )
        return self.lora

    def adapter_pages(self, lora_path: str, block_size: int) -> int:
        """Pool pages of `block_size` tokens the adapter at `lora_path` takes; it is read
        and checked against the base (InvalidParameterError naming the field or tensor)."""
        return self._lora().adapter_pages(lora_path, block_size)

    def max_adapter_pages(self, block_size: int) -> int:
        """Pages of an adapter of max_lora_rank on every target (a static slot)."""
        return self._lora().max_adapter_pages(block_size)

    def drop_adapter(self, lora_id: int) -> None:
        """Forget the adapter's host copy."""
        if self.lora is not None:
            self.lora.drop_adapter(lora_id)

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
