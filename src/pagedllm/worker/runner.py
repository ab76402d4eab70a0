"""The model-runner interface: what the engine asks of whatever runs the model.

Each step the engine hands a runner plain data (the scheduler's output, one `SampleRow`
per token to draw, and the token bitmask of the rows that follow a grammar) and gets the
drawn tokens back; it never touches the model's tensors.
Behind this one interface sit the real runner (`TorchModelRunner`), `FakeModelRunner`
for bookkeeping simulations and property tests, and any runner that splits the model
across devices. Plain Python: importing it needs no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.sampling_params import SamplingParams


@dataclass(frozen=True)
class ModelSpec:
    """What the engine needs to know of a model to schedule it."""

    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...] = ()
    num_layers: int = 1
    # Each layer's attention window in tokens (None: full attention); None: all full.
    layer_windows: tuple[int | None, ...] | None = None


@dataclass(frozen=True)
class SampleRow:
    """One token to draw for sequence `seq_id`, from logits row `logits_row` (the rows
    follow the scheduled sequences that need logits, in order)."""

    logits_row: int
    seq_id: int
    params: SamplingParams
    seed: int | None = None  # the sample's own seed: its draws do not depend on the batch
    # Penalties: the sequence's tokens, sent while the runner lacks their counts
    prompt_ids: tuple[int, ...] | list[int] = ()
    output_ids: tuple[int, ...] | list[int] = ()
    suppressed_ids: tuple[int, ...] = ()  # EOS and stop ids while under min_tokens
    num_logprobs: int = 0
    # Structured output: the row of the step's grammar bitmask that holds the tokens it
    # may draw (-1: no grammar)
    grammar_row: int = -1
    # Speculative decoding: the proposed tokens this row checks. Its logits are then the
    # k+1 rows from logits_row on; the runner keeps the proposals the model agrees with
    # (worker/spec_verify.py) and draws one token of its own after them.
    draft_token_ids: tuple[int, ...] = ()
    num_output_tokens: int = 0  # output tokens before this step (min_tokens per position)
    # A runner with a draft model: after the draw, propose up to this many tokens for the
    # sequence's next step (SampledTokens.next_proposals).
    num_proposals: int = 0
    # Penalties: the runner already counts the sequence's tokens (built from the ids of an
    # earlier row, worker/penalty_rows.py), so this row carries none of them.
    runner_counts: bool = False


@dataclass(frozen=True)
class PromptLogprobsRow:
    """Prompt tokens whose log-probabilities scheduled sequence `seq_index` (its place in
    the step's `seqs`) computes this step: the logits at its chunk's positions `first`,
    `first + 1`, ... score `target_ids`, the prompt tokens that follow them."""

    seq_index: int
    first: int
    target_ids: tuple[int, ...]
    num_logprobs: int  # the most likely tokens to report at each position


@dataclass(frozen=True)
class PromptLogprobs:
    """A PromptLogprobsRow's answer, one entry per target token: its log-probability
    (log_softmax of the logits in float32) and the num_logprobs most likely tokens."""

    logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


@dataclass(frozen=True)
class AcceptedDrafts:
    """A speculating row's proposals the model kept, in order, before the row's own
    token (token_ids[row] of SampledTokens), with their log-probabilities."""

    token_ids: list[int]
    logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


@dataclass(frozen=True)
class SampledTokens:
    token_ids: list[int]
    logprobs: list[float]  # of each chosen token, under the model's raw distribution
    top_ids: list[list[int]]  # per row, the num_logprobs most likely tokens
    top_logprobs: list[list[float]]
    # row -> why drawing it failed; that row's entries above are placeholders, and only
    # its request fails
    row_errors: dict[int, str] = field(default_factory=dict)
    # row -> its kept proposals, for every row that checked proposals (SampleRow's
    # draft_token_ids), even when it kept none
    accepted: dict[int, AcceptedDrafts] = field(default_factory=dict)
    # row -> the tokens a draft model proposes for its sequence's next step, drawn after
    # this step's tokens (rows with num_proposals; worker/draft_model.py)
    next_proposals: dict[int, tuple[int, ...]] = field(default_factory=dict)
    # One per PromptLogprobsRow the step was given, in order
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)


class ModelRunner(Protocol):
    spec: ModelSpec

    def kv_bytes_per_block(self, block_size: int) -> int:
        """Bytes one KV block of `block_size` tokens takes on this runner."""
        ...

    def init_kv_cache(
        self,
        num_blocks: int,
        block_size: int,
        layer_groups: tuple[tuple[int, ...], ...] | None = None,
        null_block: bool = False,
    ) -> None:
        """Allocate the KV pool, once, before the first step: `num_blocks` blocks each
        holding the K/V of one layer group (`layer_groups[g]`: the layers of group g, all
        of one size; None: one group of every layer), plus one more, the null block that
        tables name behind a window, with `null_block`."""
        ...

    def execute(
        self,
        step: SchedulerOutput,
        rows: Sequence[SampleRow],
        grammar_bitmask: Any = None,
        prompt_rows: Sequence[PromptLogprobsRow] = (),
    ) -> SampledTokens:
        """Run the step's forward pass (copy-on-write copies first) and draw `rows`.
        `grammar_bitmask`: int32 [grammar rows, ceil(vocab / 32)], one bit per token, the
        rows with a `grammar_row` may draw (None when none has). A row whose draw fails
        goes to `row_errors`; a failed forward pass raises. `prompt_rows`: the prompt
        tokens to score (SampledTokens.prompt_logprobs)."""
        ...

    def adapter_pages(self, lora_path: str, block_size: int) -> int:
        """Pool pages (blocks of `block_size` tokens) the LoRA adapter at `lora_path`
        takes; the adapter is read and checked against the base model (a bad one raises
        InvalidParameterError naming the field or tensor)."""
        ...

    def max_adapter_pages(self, block_size: int) -> int:
        """Pages of an adapter of max_lora_rank on every target: a static slot's size."""
        ...

    def drop_adapter(self, lora_id: int) -> None:
        """Forget the adapter's host copy (the engine removed it)."""
        ...

    def shutdown(self) -> None:
        """Release what the runner holds (processes, devices)."""
        ...
