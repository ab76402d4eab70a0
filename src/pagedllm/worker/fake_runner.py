"""FakeModelRunner: a model runner with no model, for bookkeeping runs and property tests.

It computes nothing: each row draws a chosen token (always `token`, or random with a
seed), with made-up log-probabilities for the candidates a beam search asks for and for
the prompt tokens a request scores. A row
that checks proposed tokens (speculative decoding) keeps a deterministic number of them
(`num_accepted`), so that runs cover both kept and rejected proposals. It keeps the
block tables as the real runner does, from each step's changes (`tables`, the same
BatchTables over lists), and the penalty counts (`penalties`, the same PenaltyRows over
sets and Counters), so that tests can hold them against the scheduler's and the
engine's. LoRA adapters are sized from their adapter_config.json alone (rank and
targets, `lora_rank_bytes` per unit of rank and target), with no weights. Driving the
real LLMEngine with it gives the engine's exact block, admission and preemption figures
at thousands of steps per second, without torch.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.lora.peft_config import TARGETS, read_peft_config
from pagedllm.worker.batch_tables import BatchTables, ListTableStore
from pagedllm.worker.penalty_rows import ListCountStore, PenaltyRows
from pagedllm.worker.runner import (
    AcceptedDrafts,
    ModelSpec,
    PromptLogprobs,
    PromptLogprobsRow,
    SampledTokens,
    SampleRow,
)


def default_num_accepted(row: SampleRow) -> int:
    """How many of a row's proposals the fake model keeps: cycles through 0..k with the
    sequence's length, so a run sees every count from none to all."""
    k = len(row.draft_token_ids)
    return (row.seq_id + row.num_output_tokens) % (k + 1)


class FakeModelRunner:
    def __init__(
        self,
        spec: ModelSpec,
        token: int = 0,
        seed: int | None = None,
        kv_bytes_per_token: int = 1,
        num_accepted: Callable[[SampleRow], int] = default_num_accepted,
        max_lora_rank: int = 16,
        lora_rank_bytes: int = 64,
    ) -> None:
        """`kv_bytes_per_token`: what a token's K/V would take, for sizing the pool from a
        byte budget (default 1: a budget in bytes is then one in tokens). `num_accepted`:
        how many of a speculating row's proposals to keep (clamped to 0..k).
        `max_lora_rank`: the largest adapter rank accepted; `lora_rank_bytes`: the bytes
        an adapter takes per unit of rank on each of its targets."""
        if not 0 <= token < spec.vocab_size:
            raise ValueError(f"token must be in [0, {spec.vocab_size - 1}], got {token}")
        if kv_bytes_per_token < 1:
            raise ValueError(f"kv_bytes_per_token must be >= 1, got {kv_bytes_per_token}")
        self.spec = spec
        self.token = token
        self.rng = random.Random(seed) if seed is not None else None
        self.kv_bytes_per_token = kv_bytes_per_token
        self.num_accepted = num_accepted
        self.max_lora_rank = max_lora_rank
        self.lora_rank_bytes = lora_rank_bytes
        self.dropped_adapters: list[int] = []
        self.tables = BatchTables(1, ListTableStore(1))
        # Penalty counts kept as the real runner keeps them, so that tests can hold them
        # against the engine's sequences (and a row that leans on missing ones fails).
        self.penalty_counts = ListCountStore()
        self.penalties = PenaltyRows(self.penalty_counts)

    def kv_bytes_per_block(self, block_size: int) -> int:
        return block_size * self.kv_bytes_per_token

    def _pages(self, rank: int, targets: int, block_size: int) -> int:
        return -(-rank * targets * self.lora_rank_bytes // self.kv_bytes_per_block(block_size))

    def adapter_pages(self, lora_path: str, block_size: int) -> int:
        config, _ = read_peft_config(lora_path, self.spec.num_layers, self.max_lora_rank)
        return self._pages(config.r, len(config.targets), block_size)

    def max_adapter_pages(self, block_size: int) -> int:
        return self._pages(self.max_lora_rank, len(TARGETS), block_size)

    def drop_adapter(self, lora_id: int) -> None:
        self.dropped_adapters.append(lora_id)

    def init_kv_cache(
        self,
        num_blocks: int,
        block_size: int,
        layer_groups: tuple[tuple[int, ...], ...] | None = None,
        null_block: bool = False,
    ) -> None:
        num_groups = 1 if layer_groups is None else len(layer_groups)
        self.tables = BatchTables(num_groups, ListTableStore(num_groups))  # no K/V to hold

    def execute(
        self,
        step: SchedulerOutput,
        rows: Sequence[SampleRow],
        grammar_bitmask: Any = None,
        prompt_rows: Sequence[PromptLogprobsRow] = (),
    ) -> SampledTokens:
        self.tables.apply(step)
        self.penalties.apply(step, rows)
        # No logits to mask: a row with a grammar draws `token` like any other.
        vocab = self.spec.vocab_size
        tokens, top_ids, top_lps = [], [], []
        accepted: dict[int, AcceptedDrafts] = {}
        for i, row in enumerate(rows):
            if row.draft_token_ids:
                k = len(row.draft_token_ids)
                a = max(0, min(k, self.num_accepted(row)))
                kept = list(row.draft_token_ids[:a])
                accepted[i] = AcceptedDrafts(
                    kept, [-0.5] * a, [[] for _ in kept], [[] for _ in kept]
                )
            k = min(row.num_logprobs, vocab)
            if self.rng is None:
                token = self.token
                candidates = [(self.token + i) % vocab for i in range(k)]
            else:
                token = self.rng.randrange(vocab)
                candidates = self.rng.sample(range(vocab), k)
            tokens.append(token)
            top_ids.append(candidates)
            top_lps.append([-0.5 * (i + 1) for i in range(k)])  # best first
        sampled = SampledTokens(
            tokens,
            [-0.5] * len(rows),
            top_ids,
            top_lps,
            {},
            accepted,
            prompt_logprobs=[self._prompt_logprobs(r) for r in prompt_rows],
        )
        self.penalties.add(rows, sampled)
        return sampled

    def _prompt_logprobs(self, row: PromptLogprobsRow) -> PromptLogprobs:
        """Made-up scores: each target token -0.5, and the num_logprobs tokens from the
        target on, best first."""
        vocab, k = self.spec.vocab_size, min(row.num_logprobs, self.spec.vocab_size)
        return PromptLogprobs(
            [-0.5] * len(row.target_ids),
            [[(t + i) % vocab for i in range(k)] for t in row.target_ids],
            [[-0.5 * (i + 1) for i in range(k)] for _ in row.target_ids],
        )

    def shutdown(self) -> None:
        pass
