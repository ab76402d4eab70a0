"""Beam search inside the engine, scored exactly as transformers' `generate(num_beams=k,
do_sample=False, early_stopping=False)` does.

Each step every live beam proposes its max(2, 1 + #EOS) * k best next tokens; of all
candidates, the k best that do not end the beam live on (a beam with several surviving
children forks, one with none is freed, so surviving beams share their common history's
blocks), and candidates
among the k best that end (EOS, or the length limit) join the finished hypotheses, scored
by sum of log-probabilities / generated_length ** length_penalty. Like transformers' default
("heuristic" early stopping), the search ends when all k finished slots are filled and the
best live beam, scored at its current length, cannot beat the worst finished one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pagedllm.core.sequence import Sequence
from pagedllm.sampling_params import BeamSearchParams

NEG_INF = -1.0e9


@dataclass(frozen=True)
class Hypothesis:
    token_ids: tuple[int, ...]  # generated tokens, EOS included when it ended the beam
    score: float  # length-normalised
    logprob: float  # sum of log-probabilities


@dataclass
class BeamState:
    params: BeamSearchParams
    eos_token_ids: frozenset[int]
    finished: list[Hypothesis] = field(default_factory=list)  # best first, at most k
    improvable: bool = True  # transformers' is_early_stop_heuristic_unsatisfied

    def add_finished(self, hyps: list[Hypothesis]) -> None:
        merged = sorted([*self.finished, *hyps], key=lambda h: h.score, reverse=True)
        self.finished = merged[: self.params.beam_width]


Candidate = tuple[float, int, int]  # (accumulated log-prob, beam index, token)


def advance_beams(
    state: BeamState,
    beams: list[Sequence],
    top: list[tuple[list[int], list[float]]],
    fork: Callable[[Sequence], Sequence],
    drop: Callable[[Sequence], None],
) -> bool:
    """One beam-search step for `beams` (all the live beams, of equal length) given each
    beam's best next tokens and log-probs (as many as candidates are kept). `fork(beam)`
    returns a new sequence sharing the beam's blocks; `drop(beam)` frees one. When the
    search is over (True), every beam has been dropped."""
    k = state.params.beam_width
    prompt_len = beams[0].num_prompt_tokens
    gen_len = beams[0].num_tokens - prompt_len + 1  # generated tokens after this step
    at_limit = gen_len >= state.params.max_tokens
    candidates: list[Candidate] = [
        (beam.cumulative_logprob + lp, b, tok)
        for b, (beam, (ids, lps)) in enumerate(zip(beams, top, strict=True))
        for tok, lp in zip(ids, lps, strict=True)
    ]
    candidates.sort(key=lambda c: c[0], reverse=True)
    candidates = candidates[: len(top[0][0])]  # as many as each beam proposed

    def ends(token: int) -> bool:
        return at_limit or (not state.params.ignore_eos and token in state.eos_token_ids)

    if state.improvable:
        new = [
            Hypothesis(
                (*beams[b].output_token_ids, tok),
                score / gen_len**state.params.length_penalty,
                score,
            )
            for score, b, tok in candidates[:k]
            if ends(tok)
        ]
        state.add_finished(new)
    survivors = [c for c in candidates if not ends(c[2])][:k]

    best_running = survivors[0][0] if survivors else NEG_INF
    if len(state.finished) == k:
        worst = state.finished[-1].score
        state.improvable &= best_running / gen_len**state.params.length_penalty > worst
    done = not survivors or not state.improvable

    # Re-form the live beams: a beam's first survivor continues it, further ones fork it.
    children: dict[int, list[Candidate]] = {}
    for c in survivors if not done else []:
        children.setdefault(c[1], []).append(c)
    for b, beam in enumerate(beams):
        for score, _, tok in children.get(b, [])[1:]:
            child = fork(beam)
            child.token_ids.append(tok)
            child.cumulative_logprob = score
    for b, beam in enumerate(beams):
        if b in children:
            score, _, tok = children[b][0]
            beam.token_ids.append(tok)
            beam.cumulative_logprob = score
        else:
            drop(beam)
    return done
