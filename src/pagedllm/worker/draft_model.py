"""DraftProposer: speculative decoding's draft model, run by the model runner after the
target's forward pass and sampling, proposing the tokens the next step checks.

The draft shares the target's KV bookkeeping: the same block tables and block ids, over
a second set of K/V tensors (its own PagedKVCache with as many blocks), so trimming,
copy-on-write, preemption and prefix caching need no bookkeeping of their own; a block's
bytes are the target's plus the draft's. Each step, after the target drew its tokens:

1. one batch over every scheduled sequence's tokens the target kept (its chunk without
   the proposals it checked, then the proposals it accepted), so the draft's K/V holds
   exactly the positions the target's does, in the same blocks; a sequence that proposes
   next (its row's `num_proposals`) adds the token the target just drew, and from its
   logits draws its first proposal;
2. k-1 one-token steps over the proposing sequences together draw the others.

Steps 1's drawn token and 2's proposals write their K/V past the target's tokens, into
the lookahead slots the scheduler claimed for them (a row proposes no more tokens than
its tables have slots for); the next step computes those positions again, so nothing the
draft writes there is ever read once the step is over.
The proposals go back to the engine (SampledTokens.next_proposals), which schedules them
as the next step's tokens; their distributions q stay here, by sequence, for the
verifier of that step (`draft_probs`).

Proposals are drawn with the sequence's own sampling settings, as of the next step (the
sampler's logits processing, then temperature, top-k/p, min-p): greedy rows by argmax,
sampled rows from the runner's shared generator, or a seeded row from a copy of its own
taken after this step's draw: the noise the verifier then draws the row's next tokens
with, position after position, so that where the draft agrees with the target its
proposal is the token the request draws (and the request's own generator advances only
by the tokens it keeps).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch

from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.model.config import ModelConfig
from pagedllm.worker.kv_cache import PagedKVCache
from pagedllm.worker.runner import SampledTokens, SampleRow
from pagedllm.worker.sampler import Sampler, exponential_noise, process_logits, sampling_probs
from pagedllm.worker.spec_verify import SpecRow, position_rows
from pagedllm.worker.token_counts import TokenCounts


class DraftRunner(Protocol):
    """What the proposer uses of the draft model's own runner (a TorchModelRunner)."""

    model_config: ModelConfig
    model: Any  # compute_logits(hidden) -> logits
    kv_cache: PagedKVCache | None

    def kv_bytes_per_block(self, block_size: int) -> int: ...

    def init_kv_cache(self, num_blocks: int, block_size: int) -> None: ...

    def run_tokens(
        self,
        cache: PagedKVCache,
        token_ids: list[int],
        start_positions: Sequence[int],
        query_lens: Sequence[int],
        block_tables: Sequence[torch.Tensor],
        logits_seq_indices: Sequence[int],
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True)
class _Proposing:
    """A sequence that proposes after this step: its sample row (`index`) and that row as
    of the next step (`row`: its output and output count include this step's tokens), how
    many proposals, the first one's position, and its place among the step's sequences (the
    row of its block tables)."""

    index: int
    row: SampleRow
    k: int
    first_pos: int
    seq_index: int


@dataclass(frozen=True)
class _Proposed:
    """One sequence's proposals and the distributions they were drawn from ([k, vocab];
    None when every sequence proposing in that step was greedy)."""

    tokens: tuple[int, ...]
    q: torch.Tensor | None


def draw_proposals(
    logits: torch.Tensor,
    rows: Sequence[SampleRow],
    generators: Sequence[torch.Generator | None],
    shared: torch.Generator | None,
    with_q: bool = True,
    counts: TokenCounts | None = None,
) -> tuple[list[int], torch.Tensor | None]:
    """One proposal per row from the draft's `logits` (row i follows rows[i]), and, with
    `with_q`, the distribution q it was drawn from ([rows, vocab]; one-hot for greedy
    rows). The verifier checks greedy rows by argmax alone: a step whose rows are all
    greedy needs no q. `counts`: the penalties' token counts, row i's for rows[i] (None:
    from the ids the rows carry)."""
    x = logits.float()
    if not all(Sampler._plain_greedy(r) for r in rows):
        x = process_logits(x.clone(), rows, counts=counts)
    tokens = x.argmax(dim=-1)
    greedy = [r.params.greedy for r in rows]
    if not with_q:
        if not all(greedy):
            raise ValueError("sampled rows need their q: call with with_q=True")
        return tokens.tolist(), None
    q = torch.zeros_like(x).scatter_(1, tokens[:, None], 1.0)
    if not all(greedy):
        probs = sampling_probs(x, rows)
        probs = probs / probs.sum(dim=-1, keepdim=True)
        drawn = (probs / exponential_noise(probs, generators, shared)).argmax(dim=-1)
        is_greedy = torch.tensor(greedy, device=x.device)
        tokens = torch.where(is_greedy, tokens, drawn)
        q = torch.where(is_greedy[:, None], q, probs)
    return tokens.tolist(), q


def _copy(generator: torch.Generator) -> torch.Generator:
    copy = torch.Generator(device=generator.device)
    copy.set_state(generator.get_state())
    return copy


class DraftProposer:
    def __init__(self, runner: DraftRunner, generator: torch.Generator | None) -> None:
        """`runner`: the draft model's own runner (its weights, its KV tensors);
        `generator`: the noise of rows without a generator of their own."""
        self.runner = runner
        self.generator = generator
        # Sequence id -> the proposals drawn after the last step, for the next one to check.
        self._proposed: dict[int, _Proposed] = {}

    @property
    def vocab_size(self) -> int:
        return self.runner.model_config.vocab_size

    @property
    def max_position_embeddings(self) -> int:
        return self.runner.model_config.max_position_embeddings

    def kv_bytes_per_block(self, block_size: int) -> int:
        return self.runner.kv_bytes_per_block(block_size)

    def init_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """The draft's K/V tensors: one per block id of the target's pool."""
        self.runner.init_kv_cache(num_blocks, block_size)

    def draft_probs(self, rows: Sequence[SampleRow]) -> torch.Tensor | None:
        """The distributions the proposals `rows` check were drawn from, in row order as
        the verifier takes them ([their proposals, vocab]); None when all were drawn by
        greedy rows (the verifier checks those by argmax alone). A row checks a prefix of
        what the draft proposed for it after the last step (the engine may cut it)."""
        checking = [(r, self._proposed.get(r.seq_id)) for r in rows if r.draft_token_ids]
        for row, made in checking:
            k = len(row.draft_token_ids)
            if made is None or tuple(row.draft_token_ids) != made.tokens[:k]:
                raise RuntimeError(
                    f"sequence {row.seq_id}: the step checks tokens the draft did not propose"
                )
        # One draw made every proposal of the last step: all carry q, or none does.
        dists = [
            made.q[: len(row.draft_token_ids)]
            for row, made in checking
            if made is not None and made.q is not None
        ]
        return torch.cat(dists) if dists else None

    @torch.inference_mode()
    def propose(
        self,
        step: SchedulerOutput,
        rows: Sequence[SampleRow],
        sampled: SampledTokens,
        generators: Sequence[torch.Generator | None],
        tables: Sequence[torch.Tensor],
        table_len: Callable[[int], int],
        counts: TokenCounts | None = None,
    ) -> dict[int, tuple[int, ...]]:
        """After the target drew `sampled` for `step`: bring the draft's K/V to the
        target's tokens, and draw up to `num_proposals` tokens for each row that asks.
        `tables`: the step's sequences' block tables per layer group (the target's);
        `table_len(seq_id)`: the entries of a sequence's first table; `counts`: the
        penalties' token counts after `sampled`, row i's for rows[i] (None: no row has
        penalties). Row -> its proposals (fewer where the tables have fewer lookahead
        slots)."""
        cache = self.runner.kv_cache
        if cache is None:
            raise RuntimeError("init_kv_cache must run before the first step")
        cache.copy_blocks(step.blocks_to_copy)
        row_of = {r.seq_id: i for i, r in enumerate(rows) if r.draft_token_ids or r.num_proposals}
        ids: list[int] = []
        starts, lens, logits_at = [], [], []
        proposing: list[_Proposing] = []
        for n, s in enumerate(step.seqs):
            tokens = list(s.token_ids[: len(s.token_ids) - len(s.draft_token_ids)])
            i = row_of.get(s.seq_id, -1) if s.needs_logits else -1
            if i >= 0 and i not in sampled.row_errors:
                kept = sampled.accepted.get(i)
                drawn = [*(kept.token_ids if kept is not None else ()), sampled.token_ids[i]]
                tokens += drawn[:-1]
                pos = s.start_pos + len(tokens)  # the drawn token's
                slots = table_len(s.seq_id) * cache.block_size
                k = min(rows[i].num_proposals, slots - pos, self.max_position_embeddings - pos)
                if k > 0:
                    tokens.append(drawn[-1])
                    logits_at.append(n)
                    proposing.append(_Proposing(i, _next_row(rows[i], drawn), k, pos + 1, n))
            ids += tokens
            starts.append(s.start_pos)
            lens.append(len(tokens))
        hidden, last = self.runner.run_tokens(cache, ids, starts, lens, tables, logits_at)
        self._proposed = {}
        if not proposing:
            return {}
        copies = [None if (g := generators[p.index]) is None else _copy(g) for p in proposing]
        after = None if counts is None else counts.take([p.index for p in proposing])
        made = self._draw(hidden[last], proposing, copies, tables, after)
        self._proposed = {rows[p.index].seq_id: m for p, m in zip(proposing, made, strict=True)}
        return {p.index: m.tokens for p, m in zip(proposing, made, strict=True)}

    def _draw(
        self,
        hidden: torch.Tensor,
        proposing: list[_Proposing],
        generators: Sequence[torch.Generator | None],
        tables: Sequence[torch.Tensor],
        counts: TokenCounts | None,
    ) -> list[_Proposed]:
        """Each proposing sequence's k proposals: the first from `hidden` (the drawn
        tokens' states), the others one draft step each, batched, over the step's
        `tables`. `counts`: the penalties' token counts, row i's for proposing[i]; a
        proposal counts those drawn before it too."""
        model, cache = self.runner.model, self.runner.kv_cache
        assert cache is not None
        with_q = not all(p.row.params.greedy for p in proposing)
        tokens: list[list[int]] = [[] for _ in proposing]
        dists: list[list[torch.Tensor]] = [[] for _ in proposing]
        active = list(range(len(proposing)))
        logits = model.compute_logits(hidden)
        j = 0
        while True:
            pos_rows = []
            for a in active:
                row = proposing[a].row
                pos_rows.append(position_rows(SpecRow(row, tokens[a], row.num_output_tokens))[-1])
            gens = [generators[a] for a in active]
            pos_counts = None
            if counts is not None:
                pos_counts = counts.take(active).plus([tokens[a] for a in active])
            new, q = draw_proposals(logits, pos_rows, gens, self.generator, with_q, pos_counts)
            for m, a in enumerate(active):
                tokens[a].append(new[m])
                if q is not None:
                    dists[a].append(q[m])
            j += 1
            active = [a for a in active if proposing[a].k > j]
            if not active:
                break
            # Proposal j-1 goes in at its lookahead slot.
            index = torch.tensor([proposing[a].seq_index for a in active])
            hidden, last = self.runner.run_tokens(
                cache,
                [tokens[a][j - 1] for a in active],
                [proposing[a].first_pos + j - 1 for a in active],
                [1] * len(active),
                [t[index] for t in tables],
                list(range(len(active))),
            )
            logits = model.compute_logits(hidden[last])
        return [
            _Proposed(tuple(tokens[a]), torch.stack(dists[a]) if with_q else None)
            for a in range(len(proposing))
        ]


def _next_row(row: SampleRow, drawn: list[int]) -> SampleRow:
    """`row` as of the next step, after the step's `drawn` tokens: min_tokens suppression
    ends where it would (the runner's penalty counts hold them already)."""
    return replace(
        row,
        num_output_tokens=row.num_output_tokens + len(drawn),
        draft_token_ids=(),
    )
