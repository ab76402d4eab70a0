"""The verifier: given the target model's logits at each speculating sequence's k+1
positions, keeps the proposed tokens the target agrees with and adds one token of its
own, so that the output has exactly the distribution of drawing each token in turn.

Row i holds k_i proposed tokens d_0..d_{k-1} and k_i + 1 consecutive logits rows from
`sample.logits_row`: position j scores the token after the context plus d_0..d_{j-1}.
Each position gets the sampler's own processing (worker/sampler.py: min_tokens, bias,
penalties over the output so far plus the proposals before it, temperature, top-k/p,
min-p), then:
* greedy rows keep the longest prefix of proposals equal to the target's argmax, plus
  the argmax at the first position that differs (or after the last proposal);
* seeded sampled rows draw each position's token as the sampler would, one Exp(1) race
  over the vocabulary from the row's own generator, position after position, and keep
  the proposals up to the first position whose drawn token differs: the tokens, and the
  generator's state after them, are those of decoding without speculation, so a seeded
  request's tokens do not depend on whether it speculated (nor on the batch). A proposal
  is kept with probability p(d_j), the output has p's distribution since it is p's draw;
* other sampled rows do rejection sampling (Leviathan et al. 2023): d_j is accepted with
  probability min(1, p(d_j) / q(d_j)); at the first rejection the token is drawn from
  max(0, p - q) renormalised; with every proposal accepted, a bonus token from p. The
  n-gram proposer's q is one-hot at its proposal: accept with probability p(d_j), and on
  rejection draw from p with d_j removed. Randomness: per proposal a uniform, then one
  Exp(1) race for the final token, from the verifier's generator.
A row with no proposals is an ordinary draw and takes exactly the token the sampler takes
from the same generator state. Log-probs are the target's raw ones at each accepted
position, as the sampler reports them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from pagedllm.worker.runner import SampleRow
from pagedllm.worker.sampler import Sampler, process_logits, sampling_probs
from pagedllm.worker.token_counts import TokenCounts


@dataclass(frozen=True)
class SpecRow:
    """One speculating sequence in a step. `sample` carries its settings as the sampler
    takes them; its logits_row is the first of the sequence's k+1 logits rows."""

    sample: SampleRow
    draft_token_ids: tuple[int, ...] | list[int]
    # Output tokens before this step: min_tokens suppression (sample.suppressed_ids)
    # holds at position j while num_output_tokens + j < min_tokens.
    num_output_tokens: int


@dataclass(frozen=True)
class VerifiedTokens:
    """Per row: the accepted proposals and then the target's own token."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]  # of each token, under the target's raw distribution
    top_ids: list[list[list[int]]]  # per token, the num_logprobs most likely tokens
    top_logprobs: list[list[list[float]]]
    # row -> why verifying it failed; its entries above are empty, and only its request fails
    row_errors: dict[int, str] = field(default_factory=dict)

    @property
    def num_accepted(self) -> list[int]:
        """Proposals accepted per row (a failed row counts 0)."""
        return [max(len(t) - 1, 0) for t in self.token_ids]


def position_rows(row: SpecRow) -> list[SampleRow]:
    """The sampler's row for each of `row`'s k+1 positions: min_tokens suppression ends
    where it would (penalties see the proposals before each position: position_counts)."""
    s, p = row.sample, row.sample.params
    return [
        replace(
            s,
            logits_row=s.logits_row + j,
            suppressed_ids=s.suppressed_ids if row.num_output_tokens + j < p.min_tokens else (),
        )
        for j in range(len(row.draft_token_ids) + 1)
    ]


def position_counts(counts: TokenCounts, drafts: Sequence[Sequence[int]]) -> TokenCounts:
    """The penalties' counts at each position of rows that check `drafts` (row i's
    counts are counts' row i): a position counts the proposals before it as output."""
    index = [i for i, d in enumerate(drafts) for _ in range(len(d) + 1)]
    return counts.take(index).plus([d[:j] for d in drafts for j in range(len(d) + 1)])


class SpecVerifier:
    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator  # the noise of rows without a generator of their own

    @torch.inference_mode()
    def __call__(
        self,
        logits: torch.Tensor,
        rows: Sequence[SpecRow],
        draft_probs: torch.Tensor | None = None,
        generators: Sequence[torch.Generator | None] | None = None,
        counts: TokenCounts | None = None,
    ) -> VerifiedTokens:
        """Verify `rows` against `logits` ([rows of the step, vocab]). `draft_probs`
        ([sum of k_i, vocab], the rows' proposals in order) is the distribution each
        proposal was drawn from; None means one-hot (n-gram). `counts`: the penalties'
        token counts before the step, row i's for rows[i] (None: from the ids the rows'
        samples carry). If the batch fails, each row is verified alone, and a row that
        fails alone goes to `row_errors`."""
        rows = list(rows)
        gens = list(generators) if generators is not None else [None] * len(rows)
        states = [g.get_state() if g is not None else None for g in gens]
        try:
            return self._verify(logits, rows, draft_probs, gens, counts)
        except Exception:
            return self._verify_each(logits, rows, draft_probs, gens, states, counts)

    def _verify_each(
        self,
        logits: torch.Tensor,
        rows: list[SpecRow],
        draft_probs: torch.Tensor | None,
        gens: list[torch.Generator | None],
        states: list[torch.Tensor | None],
        counts: TokenCounts | None,
    ) -> VerifiedTokens:
        out = VerifiedTokens([], [], [], [], {})
        offset = 0
        for i, (row, gen, state) in enumerate(zip(rows, gens, states, strict=True)):
            k = len(row.draft_token_ids)
            if gen is not None and state is not None:
                gen.set_state(state)
            try:
                q = None if draft_probs is None else draft_probs[offset : offset + k]
                alone = None if counts is None else counts.take([i])
                one = self._verify(logits, [row], q, [gen], alone)
            except Exception as exc:
                one = VerifiedTokens([[]], [[]], [[]], [[]])
                out.row_errors[i] = f"{type(exc).__name__}: {exc}"
            offset += k
            out.token_ids.extend(one.token_ids)
            out.logprobs.extend(one.logprobs)
            out.top_ids.extend(one.top_ids)
            out.top_logprobs.extend(one.top_logprobs)
        return out

    def _verify(
        self,
        logits: torch.Tensor,
        rows: list[SpecRow],
        draft_probs: torch.Tensor | None,
        gens: list[torch.Generator | None],
        counts: TokenCounts | None = None,
    ) -> VerifiedTokens:
        device = logits.device
        if not rows:
            return VerifiedTokens([], [], [], [])
        drafts = [[int(t) for t in r.draft_token_ids] for r in rows]
        ks = [len(d) for d in drafts]
        _check(logits, rows, drafts, draft_probs)
        pos_rows = [pr for r in rows for pr in position_rows(r)]
        # First position of each row, and each proposal's position, in position order.
        starts = [0]
        for k in ks:
            starts.append(starts[-1] + k + 1)
        draft_pos = [starts[i] + j for i, k in enumerate(ks) for j in range(k)]
        flat_draft = [t for d in drafts for t in d]

        order = [pr.logits_row for pr in pos_rows]
        x = logits
        if order != list(range(logits.shape[0])):
            x = logits.index_select(0, torch.tensor(order, device=device))
        x = x.float()
        plain = all(Sampler._plain_greedy(pr) for pr in pos_rows)
        if not plain and x is logits:  # the filters below write into it: never the caller's
            x = x.clone()
        raw_logprobs = None if plain else x.log_softmax(dim=-1)
        if not plain:
            pos_counts = None
            if any(r.sample.params.has_penalties for r in rows):
                if counts is None:
                    counts = TokenCounts.of_rows([r.sample for r in rows], x.shape[1], device)
                pos_counts = position_counts(counts, drafts)
            x = process_logits(x, pos_rows, counts=pos_counts)
        target = x.argmax(dim=-1)
        sampled = [not r.sample.params.greedy for r in rows]
        probs = sampling_probs(x, pos_rows) if any(sampled) else None
        raced = [s and g is not None for s, g in zip(sampled, gens, strict=True)]
        if any(raced):
            assert probs is not None
            target = _race(target, probs, starts, drafts, raced, gens)
        # Rows checked by rejection sampling; raced ones are checked like greedy ones, against
        # their drawn tokens.
        rejecting = [s and not r for s, r in zip(sampled, raced, strict=True)]
        any_rejecting = any(rejecting)

        dp = torch.tensor(draft_pos, dtype=torch.long, device=device)
        dt = torch.tensor(flat_draft, dtype=torch.long, device=device)
        accepted = target[dp] == dt
        if any_rejecting and flat_draft:
            assert probs is not None
            p_x = probs[dp, dt] / probs[dp].sum(dim=-1)
            if draft_probs is None:
                q_x = torch.ones_like(p_x)
            else:
                q_x = draft_probs.float().gather(1, dt[:, None])[:, 0]
            # u < p/q, written so that q(x) = 0 (never drawn by the draft) cannot divide.
            by_ratio = torch.rand(len(flat_draft), generator=self.generator, device=device)
            by_ratio = by_ratio * q_x < p_x
            greedy_at = torch.tensor(
                [not rejecting[i] for i, k in enumerate(ks) for _ in range(k)], device=device
            )
            accepted = torch.where(greedy_at, accepted, by_ratio)
        kmax = max(ks, default=0)
        grid = torch.zeros((len(rows), kmax), dtype=torch.bool, device=device)
        if flat_draft:
            row_of = torch.tensor([i for i, k in enumerate(ks) for _ in range(k)], device=device)
            col_of = torch.tensor([j for k in ks for j in range(k)], device=device)
            grid[row_of, col_of] = accepted
        num_acc = grid.long().cumprod(dim=1).sum(dim=1)  # the accepted prefix's length
        final_pos = torch.tensor(starts[:-1], device=device) + num_acc
        final = target[final_pos]
        if any_rejecting:
            assert probs is not None
            drawn = self._final_draw(probs, final_pos, num_acc, ks, dt, draft_probs)
            final = torch.where(torch.tensor(rejecting, device=device), drawn, final)
        return self._tokens(rows, drafts, starts, num_acc.tolist(), final.tolist(), x, raw_logprobs)

    def _final_draw(
        self,
        probs: torch.Tensor,
        final_pos: torch.Tensor,
        num_acc: torch.Tensor,
        ks: list[int],
        draft_tokens: torch.Tensor,
        draft_probs: torch.Tensor | None,
    ) -> torch.Tensor:
        """Each row's token at its final position: from p after a full acceptance (the
        sampler's own race, unnormalised as it is), else from max(0, p - q)."""
        dist = probs[final_pos]
        k_t = torch.tensor(ks, device=probs.device)
        rejected = (num_acc < k_t).nonzero()[:, 0]
        if rejected.numel():
            offsets = torch.tensor([0, *ks[:-1]], device=probs.device).cumsum(0)
            at = offsets[rejected] + num_acc[rejected]  # the rejected proposal's index
            p = dist[rejected] / dist[rejected].sum(dim=-1, keepdim=True)
            if draft_probs is None:
                resid = p.scatter(1, draft_tokens[at][:, None], 0.0)
            else:
                resid = (p - draft_probs[at].float()).clamp_min(0.0)
            # A rejection needs p(d) < q(d), so the residual has mass; rounding aside.
            lost = resid.sum(dim=-1, keepdim=True) <= 0
            dist = dist.index_put((rejected,), torch.where(lost, p, resid))
        noise = torch.empty_like(dist).exponential_(generator=self.generator)
        return (dist / noise).argmax(dim=-1)

    @staticmethod
    def _tokens(
        rows: list[SpecRow],
        drafts: list[list[int]],
        starts: list[int],
        num_acc: list[int],
        final: list[int],
        x: torch.Tensor,
        raw_logprobs: torch.Tensor | None,
    ) -> VerifiedTokens:
        token_ids = [[*d[:a], f] for d, a, f in zip(drafts, num_acc, final, strict=True)]
        positions = [
            s + j for s, ts in zip(starts[:-1], token_ids, strict=True) for j in range(len(ts))
        ]
        flat = [t for ts in token_ids for t in ts]
        pos = torch.tensor(positions, device=x.device)
        tok = torch.tensor(flat, device=x.device)
        if raw_logprobs is None:  # plain greedy: the chosen logit minus the log-sum-exp
            chosen = x[pos, tok] - torch.logsumexp(x[pos], dim=-1)
        else:
            chosen = raw_logprobs[pos, tok]
        chosen_l = chosen.tolist()
        k = max(r.sample.num_logprobs for r in rows)
        if k and raw_logprobs is not None:
            top_lp, top_id = raw_logprobs[pos].topk(k, dim=-1)
            top_id_l, top_lp_l = top_id.tolist(), top_lp.tolist()
        else:
            top_id_l = top_lp_l = [[] for _ in flat]
        out = VerifiedTokens([], [], [], [])
        at = 0
        for row, ts in zip(rows, token_ids, strict=True):
            n, m = len(ts), row.sample.num_logprobs
            out.token_ids.append(ts)
            out.logprobs.append(chosen_l[at : at + n])
            out.top_ids.append([ids[:m] for ids in top_id_l[at : at + n]])
            out.top_logprobs.append([lp[:m] for lp in top_lp_l[at : at + n]])
            at += n
        return out


def _race(
    target: torch.Tensor,
    probs: torch.Tensor,
    starts: list[int],
    drafts: list[list[int]],
    raced: list[bool],
    gens: list[torch.Generator | None],
) -> torch.Tensor:
    """`target` with each raced row's tokens drawn by the sampler's race (argmax of
    probs / Exp(1) noise, a vocabulary of noise per token from the row's generator), one
    position after another until the drawn token differs from the proposal or the last
    position is drawn. Positions after that one keep `target`'s values: they are never
    read, and no noise is drawn for them, so the generator advances exactly as it would
    drawing the kept tokens one step at a time."""
    target = target.clone()
    for i, draft in enumerate(drafts):
        gen = gens[i]
        if not raced[i] or gen is None:
            continue
        for j in range(len(draft) + 1):
            p = probs[starts[i] + j]
            token = int((p / torch.empty_like(p).exponential_(generator=gen)).argmax())
            target[starts[i] + j] = token
            if j == len(draft) or token != draft[j]:
                break
    return target


def _check(
    logits: torch.Tensor,
    rows: list[SpecRow],
    drafts: list[list[int]],
    draft_probs: torch.Tensor | None,
) -> None:
    """Refuse what would index out of range (on a GPU, a device-side assert that ends the
    process rather than one request) or what the verifier cannot do exactly."""
    n_rows, vocab = logits.shape
    for row, draft in zip(rows, drafts, strict=True):
        if draft and row.sample.grammar_row >= 0:
            raise ValueError(
                "proposals are not checked against a grammar: propose no tokens for a "
                "structured-output sequence"
            )
        if any(not 0 <= t < vocab for t in draft):
            raise ValueError(f"a proposed token is outside the vocabulary [0, {vocab})")
        if not 0 <= row.sample.logits_row <= n_rows - len(draft) - 1:
            raise ValueError(
                f"logits rows {row.sample.logits_row}..{row.sample.logits_row + len(draft)} "
                f"are not all among the {n_rows} given"
            )
    k_total = sum(len(d) for d in drafts)
    if draft_probs is not None and tuple(draft_probs.shape) != (k_total, vocab):
        raise ValueError(
            f"draft_probs must be [{k_total}, {vocab}] (one row per proposal), "
            f"got {list(draft_probs.shape)}"
        )
