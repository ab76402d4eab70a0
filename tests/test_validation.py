"""check_int, the one integer check: the field and the range in every refusal, bools
refused, integer scalars of other kinds taken as ints, 64 bits at most."""

from __future__ import annotations

import numpy as np
import pytest

from pagedllm.errors import InvalidParameterError
from pagedllm.validation import check_int


@pytest.mark.parametrize(
    ("value", "bounds", "message"),
    [
        (0, {"min": 1}, "n must be an integer >= 1, got 0"),
        (True, {"min": 0}, "n must be an integer >= 0, got True"),
        (1.0, {}, "n must be an integer, got 1.0"),
        ("3", {"max": 5}, "n must be an integer <= 5, got '3'"),
        (9, {"min": 1, "max": 8}, "n must be an integer in [1, 8], got 9"),
        (2**63, {"min": 1}, "n must be an integer >= 1 (integers must fit in 64 bits), got "),
        (list(range(100)), {}, "n must be an integer, got [0, 1, 2, 3, 4, 5,"),
    ],
)
def test_a_refusal_names_the_field_and_the_range(
    value: object, bounds: dict[str, int], message: str
) -> None:
    with pytest.raises(InvalidParameterError) as info:
        check_int(value, "n", **bounds)
    assert info.value.param == "n" and str(info.value).startswith(message)
    assert len(str(info.value)) < 150


def test_an_integer_in_range_comes_back_as_an_int() -> None:
    assert check_int(np.int64(7), "n", min=0, max=7) == 7
    assert type(check_int(np.int64(7), "n")) is int
    assert check_int(-(2**63), "n") == -(2**63)
    with pytest.raises(InvalidParameterError):
        check_int(np.bool_(True), "n")


def test_the_words_can_be_the_callers() -> None:
    with pytest.raises(InvalidParameterError) as info:
        check_int(500, "prompt", min=0, max=127, subject="prompt token id")
    assert str(info.value) == "prompt token id must be an integer in [0, 127], got 500"
    with pytest.raises(InvalidParameterError, match=r"^best_of must be an integer >= n \(2\)"):
        check_int(1, "best_of", min=2, allowed="an integer >= n (2)")
