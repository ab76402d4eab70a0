"""Drawing a step's tokens when some rows check proposed tokens (speculative decoding).

Rows without proposals go through the sampler exactly as in a step without speculation;
rows with proposals go through the verifier (worker/spec_verify.py), which keeps the proposals
the model agrees with and draws one token of its own after them. Both draw from a
seeded row's own generator, so a seeded request's tokens do not depend on the batch.
The result is one SampledTokens: each row's own token where it always is, and the kept
proposals before it in `accepted`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from pagedllm.worker.runner import AcceptedDrafts, SampledTokens, SampleRow
from pagedllm.worker.sampler import Sampler
from pagedllm.worker.spec_verify import SpecRow, SpecVerifier
from pagedllm.worker.token_counts import TokenCounts


def draw_with_proposals(
    sampler: Sampler,
    verifier: SpecVerifier,
    logits: torch.Tensor,
    rows: Sequence[SampleRow],
    generators: Sequence[torch.Generator | None],
    draft_probs: torch.Tensor | None = None,
    grammar_bitmask: Any = None,
    counts: TokenCounts | None = None,
) -> SampledTokens:
    """Each row's token from `logits`; a row with `draft_token_ids` first keeps its
    accepted proposals (in `accepted`), then takes the verifier's own token.
    `draft_probs`: the distribution each proposal was drawn from ([proposals of the
    speculating rows in order, vocab]); None: one-hot, as for n-gram proposals.
    `grammar_bitmask`: the grammar rows' (they do not speculate). `counts`: the
    penalties' token counts, row i's for rows[i] (None: from the ids the rows carry)."""
    spec = [i for i, r in enumerate(rows) if r.draft_token_ids]
    if not spec:
        return sampler(logits, rows, generators, grammar_bitmask, counts)
    plain = [i for i, r in enumerate(rows) if not r.draft_token_ids]
    n = len(rows)
    token_ids, logprobs = [0] * n, [0.0] * n
    top_ids: list[list[int]] = [[] for _ in range(n)]
    top_logprobs: list[list[float]] = [[] for _ in range(n)]
    row_errors: dict[int, str] = {}
    accepted: dict[int, AcceptedDrafts] = {}
    if plain:
        drawn = sampler(
            logits,
            [rows[i] for i in plain],
            [generators[i] for i in plain],
            grammar_bitmask,
            None if counts is None else counts.take(plain),
        )
        for j, i in enumerate(plain):
            token_ids[i], logprobs[i] = drawn.token_ids[j], drawn.logprobs[j]
            top_ids[i], top_logprobs[i] = drawn.top_ids[j], drawn.top_logprobs[j]
            if j in drawn.row_errors:
                row_errors[i] = drawn.row_errors[j]
    verified = verifier(
        logits,
        [SpecRow(rows[i], rows[i].draft_token_ids, rows[i].num_output_tokens) for i in spec],
        draft_probs,
        [generators[i] for i in spec],
        None if counts is None else counts.take(spec),
    )
    for j, i in enumerate(spec):
        if j in verified.row_errors:
            row_errors[i] = verified.row_errors[j]
            accepted[i] = AcceptedDrafts([], [], [], [])
            continue
        ts, lps = verified.token_ids[j], verified.logprobs[j]
        tids, tlps = verified.top_ids[j], verified.top_logprobs[j]
        token_ids[i], logprobs[i], top_ids[i], top_logprobs[i] = ts[-1], lps[-1], tids[-1], tlps[-1]
        accepted[i] = AcceptedDrafts(ts[:-1], lps[:-1], tids[:-1], tlps[:-1])
    return SampledTokens(token_ids, logprobs, top_ids, top_logprobs, row_errors, accepted)
