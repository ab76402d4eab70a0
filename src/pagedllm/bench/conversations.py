"""Multi-turn chat workloads, and the figures of one served run of them.

A conversation opens with a passage of the text that ships with pagedllm
(bench/data/quality_text.txt) and a question about it; each later turn asks one more
question (bench/data/quality_prompts.txt). Every turn resends the whole conversation, the
model's earlier answers included, as a chat client does: a server whose prefix cache
holds the conversation computes only what the turn added. Same spec and seed, same
conversations. `TurnRecord` is what one turn measured; `summarize` turns a run's records
into one table row.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedllm.bench.output import distribution
from pagedllm.errors import InvalidParameterError
from pagedllm.validation import check_int

DATA = Path(__file__).with_name("data")


@dataclass(frozen=True)
class ChatWorkloadSpec:
    conversations: int = 8
    turns: int = 4
    passage_words: int = 150  # of the first turn's passage
    output_len: int = 16  # max_tokens of each answer
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("conversations", "turns", "passage_words", "output_len"):
            check_int(getattr(self, name), name, min=1)


@dataclass(frozen=True)
class Conversation:
    index: int
    user_turns: tuple[str, ...]  # the user's message of each turn, in order


@dataclass
class TurnRecord:
    conversation: int
    turn: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float | None = None  # from sending to the first streamed text
    latency_s: float = 0.0
    error: str = ""


def load_texts() -> tuple[list[str], list[str]]:
    """The shipped text's words and the shipped questions."""
    words = (DATA / "quality_text.txt").read_text(encoding="utf-8").split()
    questions = (DATA / "quality_prompts.txt").read_text(encoding="utf-8").splitlines()
    return words, [q.strip() for q in questions if q.strip()]


def make_conversations(
    spec: ChatWorkloadSpec, words: Sequence[str], questions: Sequence[str]
) -> list[Conversation]:
    """`spec.conversations` conversations, each opening with its own passage (distinct
    starting words, so no two share more than the chat template's system prompt)."""
    if spec.passage_words >= len(words):
        message = f"passage_words must be < the text's {len(words)} words"
        raise InvalidParameterError("passage_words", message)
    starts = len(words) - spec.passage_words
    if spec.conversations > starts:
        raise InvalidParameterError(
            "conversations", f"at most {starts} conversations with this passage length"
        )
    rng = random.Random(spec.seed)
    conversations = []
    for i, start in enumerate(rng.sample(range(starts), spec.conversations)):
        passage = " ".join(words[start : start + spec.passage_words])
        asked = rng.sample(list(questions), min(spec.turns, len(questions)))
        asked += [rng.choice(questions) for _ in range(spec.turns - len(asked))]
        first = f"Read this passage.\n\n{passage}\n\nNow answer in a few words: {asked[0]}"
        conversations.append(Conversation(i, (first, *asked[1:])))
    return conversations


def summarize(
    system: str, records: Sequence[TurnRecord], seconds: float, **config: Any
) -> dict[str, Any]:
    """One row: the prefix cache's hit rate over every prompt token, the prompt tokens
    computed, TTFT and throughput over the run's `seconds`; `config` leads the row."""
    ok = [r for r in records if not r.error]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    outputs = sum(r.output_tokens for r in ok)
    later = [r for r in ok if r.turn > 0]
    later_prompt = sum(r.prompt_tokens for r in later)
    row: dict[str, Any] = {"system": system, **config}
    row |= {"turns": len(ok), "failed": len(records) - len(ok)}
    row |= {"prompt_tokens": prompt, "cached_tokens": cached, "computed_tokens": prompt - cached}
    row["hit_rate"] = cached / prompt if prompt else None
    # Turns after the first are where a conversation's own cache can help.
    row["later_turn_hit_rate"] = (
        sum(r.cached_tokens for r in later) / later_prompt if later_prompt else None
    )
    ttfts = [1000 * r.ttft_s for r in ok if r.ttft_s is not None]
    row |= distribution(ttfts, "_ms", prefix="ttft_", digits=1)
    row |= {"output_tokens": outputs, "duration_s": round(seconds, 2)}
    row["output_throughput"] = outputs / seconds if seconds > 0 else None
    row["turn_throughput"] = len(ok) / seconds if seconds > 0 else None
    return row
