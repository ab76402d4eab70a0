"""Speculative decoding's parts before the engine wiring: the n-gram proposer's exact
choices (and a brute-force oracle on random sequences), SpeculativeConfig's validation,
greedy verification token-for-token equal to drawing each token in turn with the
sampler, rejection sampling whose output distribution is the target's (chi-square on an
8-token vocabulary, one-hot and random drafts), seeded rows drawing exactly the tokens of
decoding one at a time whatever the batch, and a failing row failing alone."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

import pytest
import torch

from pagedllm.errors import InvalidParameterError
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec.config import SpeculativeConfig, speculative_config_from
from pagedllm.spec.ngram import NgramProposer
from pagedllm.worker.runner import SampleRow
from pagedllm.worker.sampler import Sampler, sampling_probs
from pagedllm.worker.spec_verify import SpecRow, SpecVerifier

# The 0.999 quantile of chi-square with 7 degrees of freedom (8 tokens): a correct sampler
# exceeds it once in a thousand seeds; the seeds here are fixed.
CHI2_7_999 = 24.322

# --- the n-gram proposer -------------------------------------------------------------


def test_no_match_proposes_nothing() -> None:
    p = NgramProposer(1, 3, 4)
    assert p.propose([]) == []
    assert p.propose([5]) == []
    assert p.propose([1, 2, 3, 4]) == []
    # The suffix itself is not an earlier occurrence.
    assert NgramProposer(2, 2, 4).propose([1, 2, 3, 1]) == []


def test_the_longest_n_wins_over_a_more_recent_shorter_match() -> None:
    ids = [1, 2, 3, 9, 8, 3, 7, 6, 1, 2, 3]
    # n=3 ([1, 2, 3]) occurs at 0..2; n=1 ([3]) more recently at 5.
    assert NgramProposer(1, 3, 2).propose(ids) == [9, 8]
    assert NgramProposer(1, 2, 2).propose(ids) == [9, 8]  # [2, 3] only at 1..2
    assert NgramProposer(1, 1, 2).propose(ids) == [7, 6]  # [3]: the most recent, at 5
    assert NgramProposer(4, 5, 2).propose(ids) == []  # too short: min 4


def test_near_the_end_fewer_tokens_follow() -> None:
    ids = [4, 5, 6, 4, 5]
    assert NgramProposer(2, 2, 5).propose(ids) == [6, 4, 5]
    # Overlapping the suffix is allowed: [7, 7] last occurs ending one before the end.
    assert NgramProposer(2, 2, 5).propose([7, 7, 7, 7]) == [7]
    assert NgramProposer(2, 2, 5, prefer="earliest").propose([7, 7, 7, 7]) == [7, 7]


def test_the_most_recent_occurrence_is_chosen_or_the_earliest_as_vllm() -> None:
    ids = [1, 2, 10, 11, 1, 2, 20, 21, 1, 2, 30, 1, 2]
    assert NgramProposer(2, 3, 3).propose(ids) == [30, 1, 2]
    assert NgramProposer(2, 3, 3, prefer="earliest").propose(ids) == [10, 11, 1]
    # vLLM's docstring example: [1,2,3,4,2,3], n 2..3, k 4 -> [4, 2, 3].
    assert NgramProposer(2, 3, 4, prefer="earliest").propose([1, 2, 3, 4, 2, 3]) == [4, 2, 3]


def test_max_model_len_caps_the_proposal() -> None:
    ids = [1, 2, 3, 4, 1, 2]
    assert NgramProposer(2, 2, 3).propose(ids) == [3, 4, 1]
    assert NgramProposer(2, 2, 3, max_model_len=8).propose(ids) == [3, 4]
    assert NgramProposer(2, 2, 3, max_model_len=6).propose(ids) == []
    assert NgramProposer(2, 2, 3).propose([9]) == []


def _brute_force(ids: list[int], low: int, high: int, k: int, prefer: str) -> list[int]:
    for n in range(high, low - 1, -1):
        ends = [e for e in range(n - 1, len(ids) - 1) if ids[e - n + 1 : e + 1] == ids[-n:]]
        if len(ids) > n and ends:
            e = ends[-1] if prefer == "latest" else ends[0]
            return ids[e + 1 : e + 1 + k]
    return []


def test_the_proposer_agrees_with_brute_force_on_random_sequences() -> None:
    rng = random.Random(0)
    for _ in range(1500):
        ids = [rng.randrange(rng.randint(1, 4)) for _ in range(rng.randint(0, 24))]
        low = rng.randint(1, 3)
        high, k = rng.randint(low, 5), rng.randint(1, 6)
        for prefer in ("latest", "earliest"):
            got = NgramProposer(low, high, k, prefer=prefer).propose(ids)  # type: ignore[arg-type]
            assert got == _brute_force(ids, low, high, k, prefer), (ids, low, high, k, prefer)


def test_long_sequences_agree_with_brute_force_across_search_windows() -> None:
    """Sequences longer than the proposer's first search window (256 tokens): matches in
    the most recent window, in earlier ones, and ties across a window's edge."""
    rng = random.Random(1)
    for _ in range(120):
        vocab = rng.choice([2, 3, 8, 40])
        ids = [rng.randrange(vocab) for _ in range(rng.randint(250, 1400))]
        if rng.random() < 0.5:  # plant the suffix somewhere earlier
            at = rng.randrange(len(ids) - 8)
            ids[at : at + 5] = ids[-5:]
        low = rng.randint(1, 3)
        high, k = rng.randint(low, 6), rng.randint(1, 6)
        for prefer in ("latest", "earliest"):
            got = NgramProposer(low, high, k, prefer=prefer).propose(ids)  # type: ignore[arg-type]
            assert got == _brute_force(ids, low, high, k, prefer), (len(ids), low, high, k, prefer)
            assert NgramProposer(low, high, k, prefer=prefer).propose(tuple(ids)) == got  # type: ignore[arg-type]


# --- configuration -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"method": "medusa"}, "speculative_method"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"num_speculative_tokens": True}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 129}, "num_speculative_tokens"),
        ({"prompt_lookup_min": 0}, "prompt_lookup_min"),
        ({"prompt_lookup_max": 0}, "prompt_lookup_max"),
        ({"prompt_lookup_min": 4, "prompt_lookup_max": 3}, "prompt_lookup_min"),
        ({"speculative_model": "some/model"}, "speculative_model"),
        ({"method": "draft"}, "speculative_model"),
        ({"method": "draft", "speculative_model": " "}, "speculative_model"),
        ({"disable_by_batch_size": 1}, "speculative_disable_by_batch_size"),
        ({"disable_by_batch_size": 2.5}, "speculative_disable_by_batch_size"),
    ],
)
def test_config_errors_name_the_option(fields: dict, param: str) -> None:
    base = {"method": "ngram", "num_speculative_tokens": 4}
    with pytest.raises(InvalidParameterError) as err:
        SpeculativeConfig(**{**base, **fields})
    assert err.value.param == param
    assert param in str(err.value)


def test_config_from_engine_options() -> None:
    assert speculative_config_from() is None
    ngram = speculative_config_from("ngram", 3, prompt_lookup_max=4)
    assert ngram == SpeculativeConfig("ngram", 3, prompt_lookup_min=4, prompt_lookup_max=4)
    assert speculative_config_from("ngram", 3) == SpeculativeConfig("ngram", 3, 5, 5)
    assert speculative_config_from("ngram", 3, prompt_lookup_min=2).prompt_lookup_max == 2
    draft = speculative_config_from(None, 2, speculative_model="m")
    assert draft is not None and draft.method == "draft" and draft.speculative_model == "m"
    with pytest.raises(InvalidParameterError) as err:
        speculative_config_from(num_speculative_tokens=3)
    assert err.value.param == "num_speculative_tokens"
    with pytest.raises(InvalidParameterError) as err:
        speculative_config_from("ngram")
    assert err.value.param == "num_speculative_tokens"
    limited = speculative_config_from("ngram", 2, speculative_disable_by_batch_size=8)
    assert limited is not None
    assert limited.speculates_at(7) and not limited.speculates_at(8)
    # The measured default stops at 4 running sequences; None speculates at every size.
    assert ngram.disable_by_batch_size == 4
    assert SpeculativeConfig("ngram", 2).speculates_at(3)
    assert not SpeculativeConfig("ngram", 2).speculates_at(4)
    assert SpeculativeConfig("ngram", 2, disable_by_batch_size=None).speculates_at(10_000)


# --- verification --------------------------------------------------------------------


def _oracle(
    logits: torch.Tensor, row: SpecRow, until_mismatch: bool = True
) -> tuple[list[int], list[float], list]:
    """Draw position after position with the sampler, each seeing the tokens drawn
    before it as output, and stop at the first token that differs from the proposal:
    what decoding without speculation yields. With until_mismatch False, draw all k+1."""
    s, draft = row.sample, list(row.draft_token_ids)
    tokens: list[int] = []
    logprobs: list[float] = []
    tops: list = []
    for j in range(len(draft) + 1):
        under_min = row.num_output_tokens + j < s.params.min_tokens
        one = replace(
            s,
            logits_row=s.logits_row + j,
            output_ids=(*s.output_ids, *tokens) if s.params.has_penalties else (),
            suppressed_ids=s.suppressed_ids if under_min else (),
        )
        drawn = Sampler()(logits, [one])
        tokens.append(drawn.token_ids[0])
        logprobs.append(drawn.logprobs[0])
        tops.append(drawn.top_ids[0])
        if j == len(draft) or (until_mismatch and tokens[-1] != draft[j]):
            break
    return tokens, logprobs, tops


GREEDY = SamplingParams(temperature=0)
PENALISED = SamplingParams(temperature=0, repetition_penalty=1.8, presence_penalty=1.5)
MIN_TOKENS = SamplingParams(temperature=0, min_tokens=4)
# (k, proposals equal to the greedy continuation, params, num_logprobs)
GREEDY_SHAPES = [
    (3, 3, GREEDY, 0),
    (3, 1, GREEDY, 2),
    (0, 0, GREEDY, 0),
    (4, 0, PENALISED, 0),
    (4, 4, PENALISED, 1),
    (3, 3, MIN_TOKENS, 0),
    (5, 2, GREEDY, 0),
]


def _greedy_case() -> tuple[torch.Tensor, list[SpecRow], list[list[int]]]:
    """Logits, rows whose proposals follow the greedy continuation for a while, and the
    continuations. Penalised rows' logits favour tokens 11 then 12 at every position (so
    penalties over the proposals change the argmax); the min_tokens row suppresses each
    position's raw argmax while under min_tokens (so where suppression ends matters)."""
    logits = torch.randn(30, 50, generator=torch.Generator().manual_seed(1)) * 3
    rows, continuations, start = [], [], 0
    for k, good, params, num in GREEDY_SHAPES:
        span = slice(start, start + k + 1)
        if params.has_penalties:
            logits[span, 11] += 12.0
            logits[span, 12] += 10.0
        suppressed = tuple(logits[span].argmax(dim=-1).tolist()) if params.min_tokens else ()
        sample = SampleRow(
            start,
            len(rows),
            params,
            prompt_ids=(1, 2, 3),
            suppressed_ids=suppressed,
            num_logprobs=num,
        )
        continuation = _oracle(logits, SpecRow(sample, [0] * k, 1), until_mismatch=False)[0]
        draft = [t if j < good else (t + 1) % 50 for j, t in enumerate(continuation[:k])]
        rows.append(SpecRow(sample, draft, num_output_tokens=1))
        continuations.append(continuation)
        start += k + 1
    return logits, rows, continuations


def test_greedy_verification_is_the_sampler_token_for_token() -> None:
    logits, rows, continuations = _greedy_case()
    # The cases bite: penalties over the proposals and min_tokens' end move the argmax.
    assert continuations[4][:2] == [11, 12]
    raw_best = logits.argmax(dim=-1).tolist()
    assert continuations[5][2] != raw_best[rows[5].sample.logits_row + 2]
    assert continuations[5][3] == raw_best[rows[5].sample.logits_row + 3]
    given = logits.clone()
    out = SpecVerifier()(logits, rows)
    assert torch.equal(logits, given)  # the caller's logits are never written
    assert not out.row_errors
    assert out.num_accepted == [good for _, good, _, _ in GREEDY_SHAPES]
    for row, ids, lps, tops in zip(rows, out.token_ids, out.logprobs, out.top_ids, strict=True):
        want_ids, want_lps, want_tops = _oracle(logits, row)
        assert ids == want_ids
        assert lps == pytest.approx(want_lps, abs=1e-5)
        assert tops == want_tops
    # Only plain-greedy rows: the fast path (no log-softmax) reports the same.
    plain = [
        SpecRow(replace(r.sample, num_logprobs=0), r.draft_token_ids, 0)
        for r in rows
        if r.sample.params == GREEDY
    ]
    fast = SpecVerifier()(logits, plain)
    for row, ids, lps in zip(plain, fast.token_ids, fast.logprobs, strict=True):
        want_ids, want_lps, _ = _oracle(logits, row)
        assert ids == want_ids and lps == pytest.approx(want_lps, abs=1e-5)


def _chi2(counts: Counter, probs: torch.Tensor) -> float:
    n = sum(counts.values())
    expected = probs.double() * n
    observed = torch.tensor([counts.get(t, 0) for t in range(len(probs))], dtype=torch.double)
    return float(((observed - expected) ** 2 / expected).sum())


SAMPLED = SamplingParams(temperature=0.8, top_k=7)  # 7 of 8 tokens: one has p = 0


def _targets() -> tuple[torch.Tensor, torch.Tensor]:
    """Three positions' logits on 8 tokens and the distribution the sampler draws from."""
    logits = torch.randn(3, 8, generator=torch.Generator().manual_seed(3))
    rows = [SampleRow(j, 0, SAMPLED) for j in range(3)]
    probs = sampling_probs(logits, rows)
    return logits, probs / probs.sum(dim=-1, keepdim=True)


def _check_distribution(out_tokens: list[list[int]], drafts: list[list[int]], p: torch.Tensor):
    first = Counter(ts[0] for ts in out_tokens)
    support = p[0] > 0
    assert all(support[t] for t in first)  # top-k's cut token is never emitted
    assert _chi2(first, p[0].clamp_min(1e-12)) < CHI2_7_999
    # Given the first proposal accepted, the second token is the target's at position 1.
    second = Counter(ts[1] for ts, d in zip(out_tokens, drafts, strict=True) if ts[0] == d[0])
    assert _chi2(second, p[1].clamp_min(1e-12)) < CHI2_7_999
    # The test has power: the same counts are far from a wrong distribution.
    assert _chi2(first, torch.full((8,), 1 / 8)) > 10 * CHI2_7_999


def test_rejection_sampling_of_one_hot_proposals_has_the_target_distribution() -> None:
    logits, p = _targets()
    n = 20_000
    # Proposals: the most likely token, then an unlikely one (both paths get exercised).
    drafts = [[int(p[0].argmax()), int(p[1].argsort()[1])]] * n
    rows = [SpecRow(SampleRow(0, i, SAMPLED), d, 0) for i, d in enumerate(drafts)]
    out = SpecVerifier(torch.Generator().manual_seed(11))(logits, rows)
    assert not out.row_errors
    first_accepted = sum(ts[0] == drafts[0][0] for ts in out.token_ids) / n
    assert first_accepted == pytest.approx(float(p[0].max()), abs=0.02)
    _check_distribution(out.token_ids, drafts, p)


def test_rejection_sampling_of_drafted_proposals_has_the_target_distribution() -> None:
    logits, p = _targets()
    n = 20_000
    gen = torch.Generator().manual_seed(5)
    q = torch.softmax(torch.randn(2, 8, generator=gen) * 1.5, dim=-1)  # the draft's
    drafted = torch.stack([torch.multinomial(q[j], n, True, generator=gen) for j in range(2)])
    drafts = drafted.T.tolist()
    draft_probs = q.repeat(n, 1)  # row i's proposals: rows 2i, 2i+1
    rows = [SpecRow(SampleRow(0, i, SAMPLED), d, 0) for i, d in enumerate(drafts)]
    out = SpecVerifier(torch.Generator().manual_seed(12))(logits, rows, draft_probs)
    assert not out.row_errors
    _check_distribution(out.token_ids, drafts, p)


def test_a_row_without_proposals_draws_what_the_sampler_draws() -> None:
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(4)) * 2
    params = [
        SamplingParams(temperature=0.7, logit_bias={5: 2.0}),
        SamplingParams(temperature=1.2, top_p=0.9, top_k=40),
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0, min_p=0.05, logprobs=3),
    ]
    rows = [SampleRow(i, i, sp, num_logprobs=sp.logprobs or 0) for i, sp in enumerate(params)]
    given = logits.clone()
    for seeded in (False, True):
        gens = [torch.Generator().manual_seed(40 + i) if seeded else None for i in range(4)]
        spec_gens = [torch.Generator().manual_seed(40 + i) if seeded else None for i in range(4)]
        want = Sampler(torch.Generator().manual_seed(9))(logits, rows, gens)
        got = SpecVerifier(torch.Generator().manual_seed(9))(
            logits, [SpecRow(r, (), 0) for r in rows], generators=spec_gens
        )
        assert got.token_ids == [[t] for t in want.token_ids]
        assert got.logprobs == [[lp] for lp in want.logprobs]
        assert got.top_ids == [[ids] for ids in want.top_ids]
    assert torch.equal(logits, given)  # rows in order: no copy made, nor any write


def test_a_seeded_row_is_reproducible_whatever_else_is_in_the_batch() -> None:
    logits = torch.randn(12, 64, generator=torch.Generator().manual_seed(6))
    seeded = SpecRow(SampleRow(4, 0, SamplingParams(temperature=1.0)), [3, 9, 27], 0)
    others = [
        SpecRow(SampleRow(0, 1, SamplingParams(temperature=0.9)), [1, 2, 3], 0),
        SpecRow(SampleRow(8, 2, SamplingParams(temperature=0)), [5, 6], 0),
    ]

    def run(rows: list[SpecRow], seed_of_others: int) -> list[int]:
        gens = [torch.Generator().manual_seed(77) if r is seeded else None for r in rows]
        out = SpecVerifier(torch.Generator().manual_seed(seed_of_others))(logits, rows, None, gens)
        return out.token_ids[rows.index(seeded)]

    alone = run([seeded], 0)
    assert run([others[0], seeded, others[1]], 1) == alone
    assert run([*others, seeded], 2) == alone
    # A different stream draws differently somewhere over a few seeds.
    outs = set()
    for seed in range(8):
        g = torch.Generator().manual_seed(seed)
        outs.add(tuple(SpecVerifier()(logits, [seeded], None, [g]).token_ids[0]))
    assert len(outs) > 1


def test_a_seeded_row_draws_the_tokens_of_decoding_one_at_a_time() -> None:
    """Its tokens are the sampler's draws in turn from the same generator, proposals kept
    up to the first that differs, and the generator ends where those draws leave it."""
    logits = torch.randn(5, 64, generator=torch.Generator().manual_seed(6)) * 3
    params = SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.3)
    one_at_a_time = torch.Generator().manual_seed(77)
    drawn: list[int] = []
    for j in range(3):
        row = SampleRow(j, 0, params, seed=77, output_ids=tuple(drawn))
        drawn += Sampler()(logits, [row], [one_at_a_time]).token_ids
    wrong = next(t for t in range(64) if t != drawn[2])
    seeded = torch.Generator().manual_seed(77)
    spec = SpecRow(SampleRow(0, 0, params, seed=77), [drawn[0], drawn[1], wrong, 5], 0)
    out = SpecVerifier(torch.Generator().manual_seed(1))(logits, [spec], None, [seeded])
    assert out.token_ids == [drawn]
    assert torch.equal(seeded.get_state(), one_at_a_time.get_state())


def test_a_failing_row_fails_alone() -> None:
    logits = torch.randn(9, 20, generator=torch.Generator().manual_seed(8))
    greedy = SamplingParams(temperature=0)
    good = SpecRow(SampleRow(0, 0, greedy), [int(logits[0].argmax())], 0)
    with_grammar = SpecRow(SampleRow(2, 1, greedy, grammar_row=0), [4], 0)
    out_of_vocab = SpecRow(SampleRow(4, 2, greedy), [20], 0)
    past_the_logits = SpecRow(SampleRow(6, 3, greedy), [1, 2, 3], 0)
    last = SpecRow(SampleRow(7, 4, SamplingParams(temperature=1.0)), [2], 0)
    rows = [good, with_grammar, out_of_vocab, past_the_logits, last]
    gen = torch.Generator().manual_seed(3)
    out = SpecVerifier()(logits, rows, None, [None, None, None, None, gen])
    assert set(out.row_errors) == {1, 2, 3}
    assert "grammar" in out.row_errors[1] and "vocabulary" in out.row_errors[2]
    alone = SpecVerifier()(logits, [good, last], None, [None, torch.Generator().manual_seed(3)])
    assert [out.token_ids[0], out.token_ids[4]] == alone.token_ids
    assert out.token_ids[1] == out.token_ids[2] == out.token_ids[3] == []
    assert out.num_accepted == [1, 0, 0, 0, alone.num_accepted[1]]
    with pytest.raises(ValueError, match="draft_probs"):
        SpecVerifier()._verify(logits, [good], torch.ones(2, 20), [None])
