"""OutputProcessor's stop rules on a one-letter-per-token tokenizer: EOS, stop tokens, stop
strings (across tokens, cut from the text, only after min_tokens), max_tokens."""

from __future__ import annotations

from pagedllm.core.sequence import Sequence
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.sampling_params import SamplingParams

EOS = 25


class Letters:
    """Token i is the letter chr(97 + i); EOS (25, 'z') is special."""

    eos_token_id = EOS

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(ch) - 97 for ch in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(97 + i) for i in ids if not (skip_special_tokens and i == EOS))


def run(params: SamplingParams, tokens: list[int]) -> Sequence:
    processor = OutputProcessor(Letters(), {EOS}, max_model_len=100)
    seq = Sequence(0, [0, 0], 2)
    for t in tokens:
        seq.token_ids.append(t)
        processor.check_stop(params, seq)
        if seq.finish_reason:
            break
    return seq


def test_stop_string_across_tokens_is_cut() -> None:
    seq = run(SamplingParams(stop=["cd"], max_tokens=10), [1, 2, 3, 4, 5])
    assert (seq.output_text, seq.finish_reason, seq.stop_reason) == ("b", "stop", "cd")
    assert seq.output_token_ids == [1, 2, 3]
    kept = run(SamplingParams(stop=["cd"], include_stop_str_in_output=True), [1, 2, 3, 4])
    assert kept.output_text == "bcd"


def test_stop_string_before_min_tokens_does_not_count_later() -> None:
    seq = run(SamplingParams(stop=["b"], min_tokens=4, max_tokens=6), [1, 2, 3, 4, 5, 6])
    assert (seq.output_text, seq.finish_reason) == ("bcdefg", "length")


def test_eos_stop_tokens_and_max_tokens() -> None:
    seq = run(SamplingParams(max_tokens=10), [1, EOS, 2])
    assert (seq.output_token_ids, seq.output_text, seq.finish_reason) == ([1, EOS], "b", "stop")
    seq = run(SamplingParams(max_tokens=10, ignore_eos=True), [1, EOS, 2])
    assert seq.finish_reason is None
    seq = run(SamplingParams(max_tokens=10, stop_token_ids=[3]), [1, 3, 2])
    assert (seq.finish_reason, seq.stop_reason) == ("stop", 3)
    seq = run(SamplingParams(max_tokens=10, min_tokens=3, stop_token_ids=[3]), [1, 3, 2, 3])
    assert seq.output_token_ids == [1, 3, 2, 3] and seq.stop_reason == 3
    seq = run(SamplingParams(max_tokens=2), [1, 2, 3])
    assert (seq.output_token_ids, seq.finish_reason) == ([1, 2], "length")
