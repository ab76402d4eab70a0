"""The reasoning parsers (entrypoints/server/reasoning.py): whole outputs split exactly,
with and without tags, and any way of cutting an output into stream pieces gives the
same parts joined as the whole; the engine's grammar bookkeeping that starts after the
reasoning (engine/grammars.py: with stand-in matchers, then through the offline engine).
"""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedllm import LLM, StructuredOutputs
from pagedllm.engine.grammars import Grammars
from pagedllm.entrypoints.cli import build_parser
from pagedllm.entrypoints.server.reasoning import (
    REASONING_PARSERS,
    reasoning_parser,
    reasoning_tokens,
)
from pagedllm.errors import InvalidParameterError
from pagedllm.sampling_params import SamplingParams, ThinkTokens

R1, QWEN3 = REASONING_PARSERS["deepseek_r1"], REASONING_PARSERS["qwen3"]


@pytest.mark.parametrize(
    ("text", "r1", "qwen3"),
    [
        # the template opened the block: only its end is generated
        ("I add.\n</think>\n\n4", ("I add.\n", "\n\n4"), (None, "I add.\n</think>\n\n4")),
        ("<think>I add.</think>4", ("I add.", "4"), ("I add.", "4")),
        ("4", ("4", None), (None, "4")),
        ("", (None, None), (None, None)),
        # a block never closed (cut by max_tokens): all reasoning from where it opens
        ("<think>still going", ("still going", None), ("still going", None)),
        ("Hm <think>a</think>b", ("Hm a", "b"), ("a", "Hm b")),
        ("<think></think>only", (None, "only"), (None, "only")),
        ("a</think>", ("a", None), (None, "a</think>")),
        # after the first end everything is answer, tags included
        (
            "a</think>b<think>c</think>d",
            ("a", "b<think>c</think>d"),
            ("c", "a</think>bd"),
        ),
        ("<think>a</think>b</think>", ("a", "b</think>"), ("a", "b</think>")),
        # near-tags are text
        ("a</thin>b<thinking>", ("a</thin>b<thinking>", None), (None, "a</thin>b<thinking>")),
        ("x<</think>y", ("x<", "y"), (None, "x<</think>y")),
    ],
)
def test_whole_outputs(
    text: str, r1: tuple[str | None, str | None], qwen3: tuple[str | None, str | None]
) -> None:
    assert R1.split(text) == r1
    assert QWEN3.split(text) == qwen3


def stream_parts(parser: object, pieces: list[str]) -> tuple[list[str], list[str]]:
    stream = parser.stream()  # type: ignore[attr-defined]
    reasoning, answer = [], []
    for piece in pieces:
        r, a = stream.feed(piece)
        reasoning.append(r)
        answer.append(a)
    r, a = stream.finish()
    return [*reasoning, r], [*answer, a]


def test_a_tag_cut_across_pieces_is_held_back() -> None:
    reasoning, answer = stream_parts(R1, ["Let me", " see</", "thi", "nk>\n\nIt is", " 4"])
    assert reasoning == ["Let me", " see", "", "", "", ""]
    assert answer == ["", "", "", "\n\nIt is", " 4", ""]
    # held text that never became a tag comes back in its part, at the latest at the end
    reasoning, answer = stream_parts(R1, ["a</th", "x", "b</t"])
    assert reasoning == ["a", "</thx", "b", "</t"] and answer == ["", "", "", ""]
    reasoning, answer = stream_parts(QWEN3, ["Hi <th", "ink>why", "</think", ">so", "<"])
    assert reasoning == ["", "why", "", "", "", ""]
    assert answer == ["Hi ", "", "", "so", "<", ""]
    reasoning, answer = stream_parts(QWEN3, ["Hi <thi"])
    assert reasoning == ["", ""] and answer == ["Hi ", "<thi"]


TAGGY = st.lists(st.sampled_from(["<think>", "</think>", "<", "</", "</th", "ink>", "a", "\n"]))


@given(parts=TAGGY, data=st.data())
def test_streaming_equals_whole(parts: list[str], data: st.DataObject) -> None:
    """Any text, cut anywhere: the pieces joined are the whole output's parts."""
    text = "".join(parts)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    for parser in (R1, QWEN3):
        reasoning, answer = stream_parts(parser, pieces)
        assert ("".join(reasoning) or None, "".join(answer) or None) == parser.split(text)
        # nothing is lost but the tags that delimit the reasoning
        assert len("".join(reasoning) + "".join(answer)) <= len(text)


def test_think_tokens_from_the_vocabulary() -> None:
    class Vocab:
        def __init__(self, vocab: dict[str, int]) -> None:
            self.vocab = vocab

        def get_vocab(self) -> dict[str, int]:
            return self.vocab

    tags = Vocab({"<think>": 7, "</think>": 9, "a": 1})
    assert R1.think_tokens(tags) == ThinkTokens(end=9)
    assert QWEN3.think_tokens(tags) == ThinkTokens(end=9, start=7)
    assert R1.think_tokens(Vocab({"</think>": 9})) is None
    assert R1.think_tokens(None) is None


@pytest.mark.parametrize(
    ("token_ids", "r1", "qwen3"),
    [
        ([1, 2, 9, 3], 3, 0),  # the template opened the block: through the end tag
        ([7, 1, 9, 3, 9], 3, 3),  # from the start tag to the first end tag after it
        ([1, 7, 2, 9, 3], 4, 3),  # answer text before the block is reasoning only for R1
        ([1, 2, 3], 3, 0),  # never ended: all reasoning (R1); never opened: none (Qwen3)
        ([1, 7, 2], 3, 2),  # opened and cut: to the output's end
        ([9, 1], 1, 0),
        ([], 0, 0),
    ],
)
def test_reasoning_tokens(token_ids: list[int], r1: int, qwen3: int) -> None:
    """Counted by the think tokens (<think> 7, </think> 9), tags included."""
    assert reasoning_tokens(token_ids, ThinkTokens(end=9)) == r1
    assert reasoning_tokens(token_ids, ThinkTokens(end=9, start=7)) == qwen3


def test_parser_names(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    assert parser.parse_args(["serve"]).reasoning_parser is None
    args = parser.parse_args(["serve", "--reasoning-parser", "deepseek_r1"])
    assert args.reasoning_parser == "deepseek_r1"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--reasoning-parser", "r1"])
    assert "choose from 'deepseek_r1', 'qwen3'" in capsys.readouterr().err
    assert reasoning_parser(None) is None
    assert reasoning_parser("qwen3") is QWEN3
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        reasoning_parser("r1")
    with pytest.raises(ValueError, match=r"think_tokens\.end"):
        SamplingParams(think_tokens=ThinkTokens(end=-1))


class Matcher:
    """A stand-in grammar matcher that takes any token and records them."""

    def __init__(self, accepted: list[int] | None = None) -> None:
        self.accepted = accepted if accepted is not None else []

    def accept(self, token_id: int) -> bool:
        self.accepted.append(token_id)
        return True

    def fork(self) -> Matcher:
        return Matcher(list(self.accepted))

    @property
    def terminated(self) -> bool:
        return False


def grammars() -> Grammars:
    return Grammars(None, 64, {0}, 0)


def test_the_grammar_starts_after_the_end_token() -> None:
    g = grammars()
    matcher = Matcher()
    g.add(1, matcher, ThinkTokens(end=9))  # type: ignore[arg-type]
    assert g.follows(1) and g.get(1) is None  # reasoning: drawn freely
    for token in (5, 7, 6):
        g.accept(1, token)
        assert g.get(1) is None
    g.fork(1, 2)  # a parallel sample forked in the reasoning waits too
    g.accept(1, 9)
    assert g.get(1) is matcher and matcher.accepted == []  # the end tag is not the grammar's
    g.accept(1, 4)
    g.accept(1, 9)
    assert matcher.accepted == [4, 9]  # after the end: every token is the grammar's
    assert g.get(2) is None and g.follows(2)
    g.accept(2, 9)
    g.accept(2, 3)
    assert g.get(2).accepted == [3]  # type: ignore[union-attr]
    g.forget([SimpleNamespace(seq_id=i) for i in (1, 2)])  # type: ignore[list-item]
    assert len(g) == 0


def test_a_first_token_opens_the_reasoning_or_is_the_answers() -> None:
    g = grammars()
    opened, answered = Matcher(), Matcher()
    g.add(1, opened, ThinkTokens(end=9, start=8))  # type: ignore[arg-type]
    g.add(2, answered, ThinkTokens(end=9, start=8))  # type: ignore[arg-type]
    # the first token is masked (the grammar's, or the think-start token)
    assert g.get(1) is opened and g.get(2) is answered
    g.accept(1, 8)
    assert g.get(1) is None  # reasoning
    g.accept(1, 8)
    g.accept(1, 9)
    g.accept(1, 5)
    assert opened.accepted == [5]
    g.accept(2, 9)  # not the start token: the answer, held by the grammar from here
    g.accept(2, 8)
    assert answered.accepted == [9, 8] and g.get(2) is answered


def test_a_bitmask_row_allows_one_more_token() -> None:
    from pagedllm.structured.bitmask import StepBitmask

    class Nothing:
        def fill_bitmask(self, bitmask: Any, row: int) -> None:
            bitmask[row] = 0

    mask = StepBitmask(70)
    mask.fill(0, Nothing())
    mask.allow(0, 31)  # the sign bit of an int32 word
    mask.allow(0, 40)
    assert mask.tensor[0].tolist() == [-(2**31), 1 << 8, 0]


def test_the_engines_grammar_starts_after_the_end_token(offline: LLM) -> None:
    """Through the engine, with xgrammar: each of n=2 samples (forked at the first draw)
    draws freely until the end token, then follows the regex to its end."""
    end = 504  # any token: the engine knows the tag by its id alone
    tokenizer = offline.engine.tokenizer
    params = SamplingParams(
        n=2,
        seed=0,
        max_tokens=40,
        logit_bias={end: 9},
        structured_outputs=StructuredOutputs(regex="[ab]{4}"),
        think_tokens=ThinkTokens(end=end),
    )
    (out,) = offline.generate(["Hi"], params, use_tqdm=False)
    reasoning = []
    for c in out.outputs:
        ids = list(c.token_ids)
        cut = ids.index(end)
        reasoning += ids[:cut]
        assert re.fullmatch("[ab]{4}", tokenizer.decode(ids[cut + 1 :], skip_special_tokens=True))
        assert c.finish_reason == "stop"
    free = tokenizer.decode(reasoning)
    assert free and not re.fullmatch("[ab]*", free)  # the grammar did not hold the reasoning
    with pytest.raises(InvalidParameterError) as err:
        offline.engine.check_request([1, 2], SamplingParams(think_tokens=ThinkTokens(end=10**6)))
    assert err.value.param == "think_tokens"
