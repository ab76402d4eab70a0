"""Token masks of grammar-constrained rows, applied to a whole batch of logits at once.

Each row that follows a grammar has its matcher write the tokens allowed next into one
row of an int32 bitmask (one bit per token); then one call sets every disallowed logit of
those rows to -inf, before temperature, top-k and top-p. Rows without a grammar are
left as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import xgrammar as xgr


def apply_grammar_masks(logits: torch.Tensor, rows: Sequence[tuple[int, Any]]) -> None:
    """Mask `logits` in place: `rows` holds (row index, its grammar state with
    `fill_bitmask(bitmask, row)`)."""
    batch, vocab = logits.shape
    bitmask = xgr.allocate_token_bitmask(batch, vocab)  # all allowed
    for i, state in rows:
        state.fill_bitmask(bitmask, i)
    indices = [i for i, _ in rows]
    xgr.apply_token_bitmask_inplace(
        logits, bitmask.to(logits.device, non_blocking=True), indices=indices
    )
