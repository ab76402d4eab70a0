"""Sampler: chooses each sample's next token from logits, vectorised over the batch.

Applies, in order: min_tokens suppression, logit bias, repetition/frequency/presence penalties
(over token counts: the runner's, worker/token_counts.py, or built from ids the rows carry),
the grammar masks of structured-output rows (all rows at once), temperature, top-k, top-p
and min-p; then samples with the exponential-race trick
(argmax of probs / Exp(1) noise), whose noise comes from the sample's own generator when
the request has a seed, so a seeded request draws the same tokens whatever else is in
the batch. Greedy rows take the argmax. Log-probabilities are those of the model's raw
distribution, as vLLM reports them. The steps are also functions of their own
(process_logits, sampling_probs, exponential_noise), which the speculative verifier
(worker/spec_verify.py) applies to each proposed position.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from pagedllm.worker.runner import SampledTokens, SampleRow
from pagedllm.worker.token_counts import TokenCounts


def apply_penalties(
    logits: torch.Tensor, rows: list[SampleRow], counts: TokenCounts | None = None
) -> torch.Tensor:
    """The rows' logits under their repetition, frequency and presence penalties, over
    `counts` (row i's for rows[i]; None: from the ids the rows carry)."""
    device = logits.device
    if counts is None:
        counts = TokenCounts.of_rows(rows, logits.shape[1], device)
    seen = counts.in_prompt | (counts.counts > 0)

    def col(name: str) -> torch.Tensor:
        return torch.tensor([getattr(r.params, name) for r in rows], device=device)[:, None]

    rep = col("repetition_penalty")
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    logits = logits - col("frequency_penalty") * counts.counts
    return logits - col("presence_penalty") * (counts.counts > 0).float()


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[1], device=logits.device)
    drop = ranks[None, :] >= top_k[:, None]
    # top-p applies to the distribution top-k left (renormalised), as in transformers.
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Drop a token once the more likely ones already reach top_p (the first always stays).
    drop |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def process_logits(
    logits: torch.Tensor,
    rows: Sequence[SampleRow],
    grammar_bitmask: Any = None,
    counts: TokenCounts | None = None,
) -> torch.Tensor:
    """The rows' logits after min_tokens suppression, logit bias, penalties and grammar
    masks (row i of `logits` follows rows[i]; a row's `grammar_row` names its row of
    `grammar_bitmask`; `counts`, the penalties' token counts, row i's for rows[i], None:
    from the ids the rows carry); writes into `logits` (float32, the caller's own copy)
    and returns it, or a new tensor where penalties apply."""
    rows = list(rows)
    device = logits.device
    suppressed = [(i, t) for i, r in enumerate(rows) for t in r.suppressed_ids]
    if suppressed:
        ri, ti = zip(*suppressed, strict=True)
        logits[list(ri), list(ti)] = float("-inf")
    biased = [(i, t, b) for i, r in enumerate(rows) for t, b in (r.params.logit_bias or {}).items()]
    if biased:
        bi, bt, bv = zip(*biased, strict=True)
        logits[list(bi), list(bt)] += torch.tensor(bv, dtype=logits.dtype, device=device)
    if any(r.params.has_penalties for r in rows):
        logits = apply_penalties(logits, rows, counts)
    grammars = [(i, r.grammar_row) for i, r in enumerate(rows) if r.grammar_row >= 0]
    if grammars:
        if grammar_bitmask is None:
            raise ValueError("rows with a grammar_row need the step's grammar bitmask")
        # Imported here: xgrammar loads only once a request asks for structured output.
        from pagedllm.structured.bitmask import apply_grammar_masks

        apply_grammar_masks(logits, grammar_bitmask, grammars)
    return logits


def sampling_probs(logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """The distribution each row draws from: temperature (1 for greedy rows), then
    top-k, top-p and min-p. Rows that min-p cut are not renormalised (the exponential
    race does not need it): divide by the row sums for a distribution."""
    device = logits.device
    vocab = logits.shape[1]
    temps = torch.tensor(
        [1.0 if r.params.greedy else r.params.temperature for r in rows],
        device=device,
    )
    logits = logits / temps[:, None]
    top_k = torch.tensor(
        [min(r.params.top_k, vocab) if r.params.top_k > 0 else vocab for r in rows],
        device=device,
    )
    top_p = torch.tensor([r.params.top_p for r in rows], device=device)
    # Decided from Python values: no device sync in the hot path.
    if any(0 < r.params.top_k < vocab or r.params.top_p < 1 for r in rows):
        logits = _top_k_top_p(logits, top_k, top_p)
    probs = logits.softmax(dim=-1)
    if any(r.params.min_p > 0 for r in rows):
        min_p = torch.tensor([r.params.min_p for r in rows], device=device)
        floor = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
    return probs


def exponential_noise(
    probs: torch.Tensor,
    generators: Sequence[torch.Generator | None],
    shared: torch.Generator | None,
) -> torch.Tensor:
    """Exp(1) noise shaped like `probs` for the race argmax(probs / noise), which draws
    from probs: row i's from generators[i] when it has one (its draws then do not depend
    on the batch), the others' from `shared` in one call."""
    device = probs.device
    noise = torch.empty_like(probs)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        idx = torch.tensor(unseeded, device=device)
        noise[idx] = torch.empty((len(unseeded), probs.shape[1]), device=device).exponential_(
            generator=shared
        )
    for i, g in enumerate(generators):
        if g is not None:
            noise[i].exponential_(generator=g)
    return noise


class Sampler:
    def __init__(self, generator: torch.Generator | None = None, kernels: Any = None) -> None:
        """`kernels`: the compiled CPU kernels' namespace, whose `greedy_logprobs` then
        takes plain greedy batches of float32 CPU logits (two passes over a row where
        torch takes five); None: torch alone."""
        self.generator = generator
        self.kernels = kernels

    @torch.inference_mode()
    def __call__(
        self,
        logits: torch.Tensor,
        rows: Sequence[SampleRow],
        generators: Sequence[torch.Generator | None] | None = None,
        grammar_bitmask: Any = None,
        counts: TokenCounts | None = None,
    ) -> SampledTokens:
        """Draw one token per row; `generators[i]` (if any) supplies row i's noise,
        `grammar_bitmask` the tokens of rows with a grammar_row, and `counts` (row i's
        for rows[i]; None: from the ids the rows carry) the tokens penalties read. If the
        batch fails, each row is drawn alone, and a row that fails alone is reported in
        `row_errors`: the other rows draw exactly what they would have (a seeded row from
        its generator as it was before the failed attempt)."""
        rows = list(rows)
        gens = list(generators) if generators is not None else [None] * len(rows)
        states = [g.get_state() if g is not None else None for g in gens]
        try:
            return self._draw(logits, rows, gens, grammar_bitmask, counts)
        except Exception:
            return self._draw_each(logits, rows, gens, states, grammar_bitmask, counts)

    def _draw_each(
        self,
        logits: torch.Tensor,
        rows: list[SampleRow],
        gens: list[torch.Generator | None],
        states: list[torch.Tensor | None],
        grammar_bitmask: Any,
        counts: TokenCounts | None,
    ) -> SampledTokens:
        out = SampledTokens([], [], [], [], {})
        for i, (row, gen, state) in enumerate(zip(rows, gens, states, strict=True)):
            if gen is not None and state is not None:
                gen.set_state(state)
            try:
                alone = None if counts is None else counts.take([i])
                one = self._draw(logits, [row], [gen], grammar_bitmask, alone)
            except Exception as exc:
                one = SampledTokens([0], [0.0], [[]], [[]])
                out.row_errors[i] = f"{type(exc).__name__}: {exc}"
            out.token_ids.extend(one.token_ids)
            out.logprobs.extend(one.logprobs)
            out.top_ids.extend(one.top_ids)
            out.top_logprobs.extend(one.top_logprobs)
        return out

    def _draw(
        self,
        logits: torch.Tensor,
        rows: list[SampleRow],
        gens: list[torch.Generator | None],
        grammar_bitmask: Any,
        counts: TokenCounts | None,
    ) -> SampledTokens:
        device = logits.device
        given = logits
        order = [r.logits_row for r in rows]
        if order != list(range(logits.shape[0])):  # samples forked from one row share it
            logits = logits.index_select(0, torch.tensor(order, device=device))
        if all(self._plain_greedy(r) for r in rows):
            return self._greedy(logits.float())
        logits = logits.float()
        if logits is given:  # the filters below write into it: never into the caller's
            logits = logits.clone()
        raw_logprobs = logits.log_softmax(dim=-1)
        logits = process_logits(logits, rows, grammar_bitmask, counts)

        tokens = logits.argmax(dim=-1)
        greedy = [r.params.greedy for r in rows]
        if not all(greedy):
            sampled = self._sample(logits, rows, gens)
            tokens = torch.where(torch.tensor(greedy, device=device), tokens, sampled)

        chosen = raw_logprobs.gather(1, tokens[:, None])[:, 0]
        k = max(r.num_logprobs for r in rows)
        if k:
            top_lp, top_ids = raw_logprobs.topk(k, dim=-1)
            top_ids_l, top_lp_l = top_ids.tolist(), top_lp.tolist()
        else:
            top_ids_l = top_lp_l = [[] for _ in rows]
        return SampledTokens(
            token_ids=tokens.tolist(),
            logprobs=chosen.tolist(),
            top_ids=[ids[: r.num_logprobs] for ids, r in zip(top_ids_l, rows, strict=True)],
            top_logprobs=[lp[: r.num_logprobs] for lp, r in zip(top_lp_l, rows, strict=True)],
        )

    @staticmethod
    def _plain_greedy(row: SampleRow) -> bool:
        p = row.params
        return (
            p.greedy
            and not row.num_logprobs
            and not row.suppressed_ids
            and not p.logit_bias
            and not p.has_penalties
            and row.grammar_row < 0
        )

    def _greedy(self, logits: torch.Tensor) -> SampledTokens:
        """The common case, argmax with no filters and no top log-probs: the chosen
        token's log-probability is its logit minus the row's log-sum-exp, with no
        log-softmax written over the whole vocabulary."""
        if self.kernels is not None and logits.is_cpu and logits.dim() == 2:
            tokens, logprobs = self.kernels.greedy_logprobs(logits)
        else:
            best, tokens = logits.max(dim=-1)
            logprobs = best - torch.logsumexp(logits, dim=-1)
        n = logits.shape[0]
        return SampledTokens(
            tokens.tolist(), logprobs.tolist(), [[] for _ in range(n)], [[] for _ in range(n)]
        )

    def _sample(
        self,
        logits: torch.Tensor,
        rows: list[SampleRow],
        generators: list[torch.Generator | None],
    ) -> torch.Tensor:
        probs = sampling_probs(logits, rows)
        return (probs / exponential_noise(probs, generators, self.generator)).argmax(dim=-1)
