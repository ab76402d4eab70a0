"""DraftProposer: speculative decoding's draft model, run by the model runner before the
target's forward pass.

The draft shares the target's KV bookkeeping: the same block tables and block ids, over
a second set of K/V tensors (its own PagedKVCache with as many blocks), so lookahead
slots, trimming, copy-on-write, preemption and prefix caching need no bookkeeping of
their own; a block's bytes are the target's plus the draft's. Each step:

1. one batch over every scheduled sequence's tokens the draft has not computed yet
   (prefill chunks, plain decodes, a speculating sequence's last token), so that its
   K/V keeps up with the target's; from the last token's logits each speculating
   sequence draws its first proposal;
2. k-1 one-token steps over the speculating sequences together draw the others, writing
   their K/V into the lookahead slots the scheduler allocated;
3. the target checks them (worker/spec_verify.py, with the draft's distributions q), and
   `after_step` notes how far each sequence's draft K/V now holds its tokens.

Proposals are drawn with the sequence's own sampling settings (the sampler's logits
processing, then temperature, top-k/p, min-p): greedy rows by argmax, sampled rows from
the runner's shared generator, or a seeded row from a copy of its own: the noise the
verifier then draws the row's tokens with, position after position, so that where the
draft agrees with the target its proposal is the token the request draws (and the
request's own generator advances only by the tokens it keeps).

Where the draft's K/V can be stale (which costs acceptance only: the target checks every
token): when all k proposals are accepted, the last one's position was never run through
the draft; it is kept per sequence and computed with the sequence's next step. A sequence
that ends right then leaves that slot stale, and a later prefix-cache hit on its block
reads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch

from pagedllm.core.scheduler import SchedulerOutput
from pagedllm.model.config import ModelConfig
from pagedllm.worker.kv_cache import PagedKVCache
from pagedllm.worker.runner import SampledTokens, SampleRow
from pagedllm.worker.sampler import Sampler, exponential_noise, process_logits, sampling_probs
from pagedllm.worker.spec_verify import SpecRow, position_rows


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


@dataclass
class _DraftCursor:
    """How far one sequence's draft K/V holds its tokens."""

    computed: int  # positions below hold the draft's K/V of the sequence's own tokens
    pending: list[int]  # tokens from `computed` on that the target has, the draft not yet


@dataclass(frozen=True)
class _Speculating:
    """A sequence that proposes this step: its sample row, how many proposals, where
    they go (from `chunk_end` on) and its place among the step's sequences (the row of
    its block table)."""

    row: int
    k: int
    chunk_end: int
    index: int


@dataclass(frozen=True)
class _Planned:
    """One scheduled sequence's draft work in the current step."""

    seq_id: int
    chunk_end: int  # the target computes positions below this (proposals aside)
    row: int = -1  # its sample row when it speculates
    proposals: tuple[int, ...] = ()


def draw_proposals(
    logits: torch.Tensor,
    rows: Sequence[SampleRow],
    generators: Sequence[torch.Generator | None],
    shared: torch.Generator | None,
    with_q: bool = True,
) -> tuple[list[int], torch.Tensor | None]:
    """One proposal per row from the draft's `logits` (row i follows rows[i]), and, with
    `with_q`, the distribution q it was drawn from ([rows, vocab]; one-hot for greedy
    rows). The verifier checks greedy rows by argmax alone: a step whose rows are all
    greedy needs no q."""
    x = logits.float()
    if not all(Sampler._plain_greedy(r) for r in rows):
        x = process_logits(x.clone(), rows)
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
        self._cursors: dict[int, _DraftCursor] = {}  # by sequence id
        self._planned: list[_Planned] = []

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

    @torch.inference_mode()
    def propose(
        self,
        step: SchedulerOutput,
        rows: Sequence[SampleRow],
        generators: Sequence[torch.Generator | None],
        tables: Sequence[torch.Tensor],
    ) -> tuple[SchedulerOutput, list[SampleRow], torch.Tensor | None, dict[int, tuple[int, ...]]]:
        """Draw the proposals of the rows with `draft_token_ids` (placeholders: only their
        number counts), `tables` holding the step's sequences' block tables (the target's,
        one layer group), and return the step and rows with them in place, the distributions
        they were drawn from (in row order, as the verifier takes them) and row -> its
        proposals."""
        cache = self.runner.kv_cache
        if cache is None:
            raise RuntimeError("init_kv_cache must run before the first step")
        cache.copy_blocks(step.blocks_to_copy)
        for seq_id in step.finished_seq_ids:
            self._cursors.pop(seq_id, None)
        row_of = {r.seq_id: i for i, r in enumerate(rows) if r.draft_token_ids}
        ids: list[int] = []
        starts, lens, logits_at = [], [], []
        planned: list[_Planned] = []
        spec: list[_Speculating] = []
        for n, s in enumerate(step.seqs):
            k = len(s.draft_token_ids)
            chunk = s.token_ids[: len(s.token_ids) - k]
            cursor = self._cursor(s.seq_id, s.start_pos)
            ids += [*cursor.pending, *chunk]
            starts.append(cursor.computed)
            lens.append(len(cursor.pending) + len(chunk))
            row = row_of.get(s.seq_id, -1) if k else -1
            chunk_end = s.start_pos + len(chunk)
            planned.append(_Planned(s.seq_id, chunk_end, row))
            if row >= 0:
                logits_at.append(n)
                spec.append(_Speculating(row, k, chunk_end, n))
        hidden, last = self.runner.run_tokens(cache, ids, starts, lens, tables, logits_at)
        drawn: dict[int, tuple[tuple[int, ...], torch.Tensor | None]] = {}
        if spec:
            copies = [None if g is None else _copy(g) for g in generators]
            drawn = self._draw(hidden[last], spec, rows, copies, tables[0])
        self._planned = [
            replace(p, proposals=drawn[p.row][0]) if p.row >= 0 else p for p in planned
        ]
        if not spec:
            return step, list(rows), None, {}
        by_seq = {rows[x.row].seq_id: drawn[x.row][0] for x in spec}
        seqs = tuple(
            replace(s, token_ids=(*s.token_ids[: -len(p)], *p), draft_token_ids=p)
            if (p := by_seq.get(s.seq_id)) is not None
            else s
            for s in step.seqs
        )
        new_rows = [
            replace(r, draft_token_ids=drawn[i][0]) if i in drawn else r for i, r in enumerate(rows)
        ]
        dists = [d for i in sorted(drawn) if (d := drawn[i][1]) is not None]
        q = torch.cat(dists) if dists else None  # greedy rows are checked by argmax
        return replace(step, seqs=seqs), new_rows, q, {i: drawn[i][0] for i in drawn}

    def _draw(
        self,
        hidden: torch.Tensor,
        spec: list[_Speculating],
        rows: Sequence[SampleRow],
        generators: Sequence[torch.Generator | None],
        table: torch.Tensor,
    ) -> dict[int, tuple[tuple[int, ...], torch.Tensor | None]]:
        """Row -> its k proposals and their distributions [k, vocab] (None when every
        speculating row is greedy: no q is needed then): the first from
        `hidden` (the last tokens' states), the others one draft step each, batched."""
        model, cache = self.runner.model, self.runner.kv_cache
        assert cache is not None
        ks = [x.k for x in spec]
        with_q = not all(rows[x.row].params.greedy for x in spec)
        tokens: list[list[int]] = [[] for _ in spec]
        dists: list[list[torch.Tensor]] = [[] for _ in spec]
        active = list(range(len(spec)))
        logits = model.compute_logits(hidden)
        j = 0
        while True:
            pos_rows = []
            for a in active:
                row = rows[spec[a].row]
                pos_rows.append(position_rows(SpecRow(row, tokens[a], row.num_output_tokens))[-1])
            gens = [generators[spec[a].row] for a in active]
            new, q = draw_proposals(logits, pos_rows, gens, self.generator, with_q)
            for m, a in enumerate(active):
                tokens[a].append(new[m])
                if q is not None:
                    dists[a].append(q[m])
            j += 1
            active = [a for a in active if ks[a] > j]
            if not active:
                break
            # Proposal j-1 goes in at its lookahead slot: position (chunk end) + j - 1.
            hidden, last = self.runner.run_tokens(
                cache,
                [tokens[a][j - 1] for a in active],
                [spec[a].chunk_end + j - 1 for a in active],
                [1] * len(active),
                [table[torch.tensor([spec[a].index for a in active])]],
                list(range(len(active))),
            )
            logits = model.compute_logits(hidden[last])
        return {
            x.row: (tuple(tokens[a]), torch.stack(dists[a]) if with_q else None)
            for a, x in enumerate(spec)
        }

    def after_step(self, sampled: SampledTokens) -> None:
        """The target checked the proposals: each sequence's draft K/V holds its tokens up
        to where the draft wrote what the target kept."""
        for p in self._planned:
            cursor = self._cursors.get(p.seq_id)
            if cursor is None:
                continue
            if not p.proposals:
                cursor.computed, cursor.pending = p.chunk_end, []
                continue
            kept = sampled.accepted.get(p.row)
            a = 0 if kept is None or p.row in sampled.row_errors else len(kept.token_ids)
            # The draft wrote the last token and proposals 0..k-2: with all k kept, the
            # last one is computed with the sequence's next step.
            written = min(a, len(p.proposals) - 1)
            cursor.computed = p.chunk_end + written
            cursor.pending = list(p.proposals[written:a])
        self._planned = []

    def _cursor(self, seq_id: int, start_pos: int) -> _DraftCursor:
        """The sequence's cursor, made to agree with the target computing from
        `start_pos` on."""
        cursor = self._cursors.get(seq_id)
        if cursor is None or cursor.computed + len(cursor.pending) < start_pos:
            # New to the draft (possibly past a prefix-cache hit or forked from a parent):
            # the blocks before start_pos got the draft's K/V when their writer computed them.
            cursor = _DraftCursor(start_pos, [])
        elif start_pos < cursor.computed + len(cursor.pending):  # recomputed (preemption)
            keep = max(0, start_pos - cursor.computed)
            cursor = _DraftCursor(min(cursor.computed, start_pos), cursor.pending[:keep])
        self._cursors[seq_id] = cursor
        return cursor
