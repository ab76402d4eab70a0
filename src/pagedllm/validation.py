"""check_int: the one integer check of every layer (sampling parameters, engine and
speculation configs, block sizes, prompt token ids).

A value passes if it is an integer (a Python int or any integer scalar, such as numpy's;
never a bool) within the range asked for and within 64 bits, which every integer that
reaches the kernels must fit. Otherwise InvalidParameterError names the field and says
the range, quoting the value (a container a few levels and items deep: it may be a
client's). Plain Python: every layer may import it.
"""

from __future__ import annotations

import operator
import reprlib

from pagedllm.errors import InvalidParameterError

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

_SHOWN = reprlib.Repr()
_SHOWN.maxlevel = 4
_SHOWN.maxlist = _SHOWN.maxtuple = _SHOWN.maxdict = 20
_SHOWN.maxstring = _SHOWN.maxother = 80


def shown(value: object) -> str:
    """`value` quoted in a message, at most 80 characters: a container is shown a few
    levels and items deep (repr would recurse through all of it, and fail on one nested
    a thousand deep)."""
    text = _SHOWN.repr(value) if isinstance(value, (list, tuple, dict)) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def is_int(value: object) -> bool:
    """Whether `value` is an integer within 64 bits (not a bool)."""
    return as_int(value) is not None


def as_int(value: object) -> int | None:
    """`value` as an int if it is an integer within 64 bits (not a bool), else None."""
    if isinstance(value, bool):
        return None
    try:
        number = operator.index(value)  # type: ignore[call-overload]
    except TypeError:  # floats, strings, numpy's bools
        return None
    return number if INT64_MIN <= number <= INT64_MAX else None


def int_range(low: int | None = None, high: int | None = None) -> str:
    """The range's words in a message: "an integer >= 1", "an integer in [0, 20]"."""
    if low is not None and high is not None:
        return f"an integer in [{low}, {high}]"
    if low is not None:
        return f"an integer >= {low}"
    return f"an integer <= {high}" if high is not None else "an integer"


def check_int(
    value: object,
    param: str,
    *,
    min: int | None = None,
    max: int | None = None,
    allowed: str | None = None,
    subject: str | None = None,
) -> int:
    """`value` as an int if it is an integer in [min, max] (each bound optional);
    otherwise InvalidParameterError(param) saying "<subject> must be <allowed>, got
    <value>". `allowed` defaults to the range's words (int_range), `subject` to `param`."""
    number = as_int(value)
    if number is not None and (min is None or number >= min) and (max is None or number <= max):
        return number
    allowed = allowed or int_range(min, max)
    if isinstance(value, int) and number is None and not isinstance(value, bool):
        allowed += " (integers must fit in 64 bits)"
    raise InvalidParameterError(param, f"{subject or param} must be {allowed}, got {shown(value)}")
