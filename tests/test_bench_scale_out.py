"""`pagedllm bench scale-out` without Ray: the multi-turn chat workload (seeded, each
conversation opening with its own passage of the shipped text), the figures of a run's
turn records, the comparisons between systems, and the command line. The bench's run on
a Ray cluster is tested in test_ray_serve.py, on the cluster that module starts."""

from __future__ import annotations

import pytest

from pagedllm.bench.conversations import (
    ChatWorkloadSpec,
    TurnRecord,
    load_texts,
    make_conversations,
    summarize,
)
from pagedllm.bench.scale_out import add_comparisons
from pagedllm.entrypoints.cli import build_parser
from pagedllm.errors import InvalidParameterError


def test_conversations_are_seeded_and_open_with_their_own_passage() -> None:
    words, questions = load_texts()
    assert len(words) > 2000 and len(questions) == 32
    spec = ChatWorkloadSpec(conversations=6, turns=3, passage_words=50, seed=1)
    conversations = make_conversations(spec, words, questions)
    assert conversations == make_conversations(spec, words, questions)
    assert conversations != make_conversations(
        ChatWorkloadSpec(conversations=6, turns=3, passage_words=50, seed=2), words, questions
    )
    text = " ".join(words)
    for i, conversation in enumerate(conversations):
        assert conversation.index == i and len(conversation.user_turns) == 3
        first = conversation.user_turns[0]
        passage = first.split("\n\n")[1]
        assert len(passage.split()) == 50 and passage in text
        assert all(turn in questions for turn in conversation.user_turns[1:])
        assert first.endswith(tuple(questions))
    assert len({c.user_turns[0] for c in conversations}) == 6


def test_more_turns_than_questions_still_ask_each_turn() -> None:
    words, questions = load_texts()
    spec = ChatWorkloadSpec(conversations=1, turns=40, passage_words=10)
    (conversation,) = make_conversations(spec, words, questions)
    assert len(conversation.user_turns) == 40


@pytest.mark.parametrize(
    ("spec", "param"),
    [
        (dict(turns=0), "turns"),
        (dict(output_len=0), "output_len"),
        (dict(passage_words=10**6), "passage_words"),
        (dict(passage_words=2590, conversations=50), "conversations"),
    ],
)
def test_a_workload_that_cannot_be_made_names_its_field(spec: dict, param: str) -> None:
    words, questions = load_texts()
    with pytest.raises(InvalidParameterError) as info:
        make_conversations(ChatWorkloadSpec(**spec), words, questions)
    assert info.value.param == param


def test_the_figures_of_a_run() -> None:
    records = [
        TurnRecord(0, 0, prompt_tokens=100, cached_tokens=16, output_tokens=8, ttft_s=0.5),
        TurnRecord(0, 1, prompt_tokens=130, cached_tokens=96, output_tokens=8, ttft_s=0.1),
        TurnRecord(1, 0, prompt_tokens=90, cached_tokens=0, output_tokens=6, ttft_s=0.3),
        TurnRecord(1, 1, error="HTTP 500"),
    ]
    row = summarize("prefix", records, 2.0, replicas=2)
    assert list(row)[:2] == ["system", "replicas"]
    assert (row["turns"], row["failed"]) == (3, 1)
    assert (row["prompt_tokens"], row["cached_tokens"], row["computed_tokens"]) == (320, 112, 208)
    assert row["hit_rate"] == pytest.approx(112 / 320)
    assert row["later_turn_hit_rate"] == pytest.approx(96 / 130)
    assert (row["ttft_mean_ms"], row["ttft_median_ms"]) == (300.0, 300.0)
    assert (row["output_tokens"], row["output_throughput"], row["turn_throughput"]) == (22, 11, 1.5)
    empty = summarize("pow2", [TurnRecord(0, 0, error="x")], 1.0)
    assert (empty["hit_rate"], empty["ttft_mean_ms"], empty["turns"]) == (None, None, 0)


def test_systems_are_compared_with_single_and_pow2() -> None:
    rows = [
        {"system": "prefix", "hit_rate": 0.72, "computed_tokens": 1000},
        {"system": "pow2", "hit_rate": 0.5, "computed_tokens": 2000},
        {"system": "single", "hit_rate": 0.8, "computed_tokens": 900},
    ]
    result: dict = {"results": rows, "ratios": {}}
    add_comparisons(result)
    assert [r["hit_rate_vs_single"] for r in rows] == [0.9, 0.62, 1.0]
    assert [r["computed_vs_pow2"] for r in rows] == [2.0, 1.0, 2.22]
    assert result["ratios"]["prefix"] == {"hit_rate_vs_single": 0.9, "computed_vs_pow2": 2.0}
    alone: dict = {"results": [{"system": "prefix", "hit_rate": 0.7, "computed_tokens": 9}]}
    alone["ratios"] = {}
    add_comparisons(alone)
    assert alone["results"][0]["hit_rate_vs_single"] is None


def test_the_command_line() -> None:
    args = build_parser().parse_args(
        ["bench", "scale-out", "--systems", "prefix,pow2", "--num-replicas", "3", "--turns", "5"]
    )
    assert (args.systems, args.num_replicas, args.turns, args.num_kv_blocks) == (
        ["prefix", "pow2"],
        3,
        5,
        512,
    )
    assert (args.conversations, args.output_len, args.replica_cpus) == (8, 16, 1.0)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "scale-out", "--systems", "prefix,random"])
