"""JSON from clients and from model output, bounded in how deeply it nests.

Python's json module and every walk over a parsed value recurse once per level: a value
nested a few thousand deep (a client's schema or tool-call arguments, a model's output)
would raise RecursionError wherever it is read or written again, and a grammar built from
a deep schema takes time cubic in its depth to convert. So JSON that a client or model
sends is read with `loads` and values already parsed are checked with `check_depth`: at
most MAX_DEPTH levels, else JSONTooDeepError (a ValueError, as a parse error is). Plain
Python: every layer may import it.
"""

from __future__ import annotations

import json
from typing import Any

# Containers (objects and arrays) one inside another. Real schemas and arguments stay far
# below: a schema nests 2-3 levels per level of its data, and nested models are `$ref`s.
MAX_DEPTH = 100


class JSONTooDeepError(ValueError):
    """A JSON value nested deeper than MAX_DEPTH."""

    def __init__(self) -> None:
        super().__init__(f"nests deeper than {MAX_DEPTH} levels (the most allowed)")


def loads(text: str | bytes) -> Any:
    """`json.loads(text)`; ValueError if it is not JSON, JSONTooDeepError if it nests
    deeper than MAX_DEPTH."""
    try:
        value = json.loads(text)
    except RecursionError:  # the C decoder stops at the interpreter's depth limit
        raise JSONTooDeepError() from None
    check_depth(value)
    return value


def check_depth(value: Any) -> None:
    """JSONTooDeepError if `value` (parsed JSON: dicts, lists, scalars) nests deeper than
    MAX_DEPTH; read level by level, without recursion."""
    level = [value] if isinstance(value, (dict, list)) else []
    depth = 0
    while level:
        depth += 1
        if depth > MAX_DEPTH:
            raise JSONTooDeepError()
        level = [
            child
            for item in level
            for child in (item.values() if isinstance(item, dict) else item)
            if isinstance(child, (dict, list))
        ]
