"""TokenCounts: the tokens repetition, frequency and presence penalties read, one row per
draw, as vocabulary-sized tensors; TensorCountStore: the real runner's rows of them, one
per live sequence with penalties (worker/penalty_rows.py says whose row is which).

A step gathers its rows' counts in one index, whatever their contexts' lengths; the
verifier and the draft model add the proposals before each position on top (`plus`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedllm.worker.runner import SampleRow


def _pad_ids(
    rows: Sequence[Sequence[int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    width = max((len(r) for r in rows), default=0) or 1
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, r in enumerate(rows):
        if r:
            ids[i, : len(r)] = torch.as_tensor(r, dtype=torch.long)
            mask[i, : len(r)] = True
    return ids.to(device), mask.to(device)


@dataclass(frozen=True)
class TokenCounts:
    """Per row: which tokens its prompt holds, and how often each is among its output."""

    in_prompt: torch.Tensor  # bool [rows, vocab]
    counts: torch.Tensor  # float32 [rows, vocab]

    @classmethod
    def of_ids(
        cls,
        prompts: Sequence[Sequence[int]],
        outputs: Sequence[Sequence[int]],
        vocab: int,
        device: torch.device,
    ) -> TokenCounts:
        """Row i: prompt tokens prompts[i], output tokens outputs[i]."""
        shape = (len(prompts), vocab)
        ids, mask = _pad_ids(prompts, device)
        empty = torch.zeros(shape, dtype=torch.float32, device=device)
        in_prompt = empty.clone().scatter_add_(1, ids, mask.float()) > 0
        return cls(in_prompt, empty).plus(outputs)

    @classmethod
    def of_rows(cls, rows: Sequence[SampleRow], vocab: int, device: torch.device) -> TokenCounts:
        """From the ids the rows carry."""
        for r in rows:
            if r.runner_counts and r.params.has_penalties:
                raise ValueError(
                    f"sequence {r.seq_id}'s penalty counts are the runner's: pass them"
                )
        return cls.of_ids([r.prompt_ids for r in rows], [r.output_ids for r in rows], vocab, device)

    def take(self, index: Sequence[int]) -> TokenCounts:
        """Rows index[0], index[1], ... in that order (a row may repeat)."""
        at = torch.tensor(index, dtype=torch.long, device=self.counts.device)
        # Indexing, not index_select: on CPU the latter copies rows this wide 10-50x slower.
        return TokenCounts(self.in_prompt[at], self.counts[at])

    def plus(self, outputs: Sequence[Sequence[int]]) -> TokenCounts:
        """Row i with outputs[i] counted as output tokens too (a new TokenCounts)."""
        if not any(outputs):
            return self
        ids, mask = _pad_ids(outputs, self.counts.device)
        counts = self.counts.clone().scatter_add_(1, ids, mask.float())
        return TokenCounts(self.in_prompt, counts)


class TensorCountStore:
    """Rows of token counts as tensors on the runner's device, grown by doubling."""

    def __init__(self, vocab: int, device: torch.device, rows: int = 1) -> None:
        self.in_prompt = torch.zeros((rows, vocab), dtype=torch.bool, device=device)
        self.counts = torch.zeros((rows, vocab), dtype=torch.float32, device=device)

    def build(self, row: int, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        self._fit(row + 1)
        built = TokenCounts.of_ids([prompt_ids], [output_ids], self.counts.shape[1], self.device)
        self.in_prompt[row] = built.in_prompt[0]
        self.counts[row] = built.counts[0]

    def add(self, rows: Sequence[int], token_ids: Sequence[int]) -> None:
        at = (
            torch.tensor(rows, dtype=torch.long, device=self.device),
            torch.tensor(token_ids, dtype=torch.long, device=self.device),
        )
        self.counts.index_put_(at, torch.ones(len(rows), device=self.device), accumulate=True)

    def clear(self, row: int) -> None:
        self.in_prompt[row] = False
        self.counts[row] = 0.0

    def gather(self, rows: Sequence[int]) -> TokenCounts:
        """The counts of store rows `rows`, in that order."""
        return TokenCounts(self.in_prompt, self.counts).take(rows)

    @property
    def device(self) -> torch.device:
        return self.counts.device

    def _fit(self, rows: int) -> None:
        have = self.counts.shape[0]
        if rows <= have:
            return
        grown = max(rows, 2 * have)
        pad = (grown - have, self.counts.shape[1])
        self.in_prompt = torch.cat([self.in_prompt, self.in_prompt.new_zeros(pad)])
        self.counts = torch.cat([self.counts, self.counts.new_zeros(pad)])
