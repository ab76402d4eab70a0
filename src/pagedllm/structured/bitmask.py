"""Token bitmasks of grammar-constrained rows: the engine's step bitmask, and applying it
to a whole batch of logits at once.

The engine fills one int32 bitmask row per grammar row of a step (one bit per token, the
tokens its matcher allows next) in a `StepBitmask`, allocated at the first grammar row and
reused step after step (grown when a step has more grammar rows). The runner gets the
tensor with the rows, each naming its row of it, and one call sets every disallowed logit
of those rows to -inf, before temperature, top-k and top-p. Rows without a grammar are
left as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import xgrammar as xgr


class StepBitmask:
    """The grammar rows' bitmask [rows, ceil(vocab / 32)], reused across steps."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.tensor: torch.Tensor = xgr.allocate_token_bitmask(1, vocab_size)

    def fill(self, row: int, state: Any) -> None:
        """Row `row` gets the tokens `state` (a matcher with `fill_bitmask`) allows next;
        the rows before it keep what this step wrote there."""
        if row >= self.tensor.shape[0]:
            grown = xgr.allocate_token_bitmask(
                max(row + 1, 2 * self.tensor.shape[0]), self.vocab_size
            )
            grown[: self.tensor.shape[0]] = self.tensor
            self.tensor = grown
        state.fill_bitmask(self.tensor, row)

    def allow(self, row: int, token_id: int) -> None:
        """Row `row` (filled this step) allows `token_id` too."""
        word, bit = divmod(token_id, 32)
        # int32 words: bit 31 is the sign bit
        self.tensor[row, word] |= (1 << bit) - (1 << 32 if bit == 31 else 0)


def apply_grammar_masks(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[tuple[int, int]]
) -> None:
    """Mask `logits` in place: `rows` holds (logits row, its row of `bitmask`)."""
    positions = [i for i, _ in rows]
    mask_rows = [m for _, m in rows]
    if positions != mask_rows:  # the mask's rows moved to the logits rows they mask
        moved = torch.empty((logits.shape[0], bitmask.shape[1]), dtype=bitmask.dtype)
        moved[positions] = bitmask[mask_rows]
        bitmask = moved
    xgr.apply_token_bitmask_inplace(
        logits, bitmask.to(logits.device, non_blocking=True), indices=positions
    )
