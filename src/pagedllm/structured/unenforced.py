"""JSON-schema keywords that the grammar library compiles without enforcing them.

xgrammar (0.2) turns a schema into a grammar but drops part of what some schemas say: a
`not`, an `if`/`then`, `uniqueItems`, a `$ref` outside the schema, a length beside a
`pattern`, the keywords beside an `anyOf` or an `enum`, and more (the rules below). Such
a schema compiles, and the output may break it. `find_unenforced` finds the first such
keyword, so that a request asking for `strict` output can be refused, naming it and where
it sits (a JSON Pointer), before anything is compiled. Every rule was measured by
compiling a schema and feeding the grammar an instance the schema forbids
(tests/test_schema_unenforced.py repeats each: when the library starts enforcing one, that
test says so). Plain Python, no xgrammar: the walk is iterative, so any depth is safe.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

# The formats the library writes a grammar for; any other is dropped.
FORMATS = frozenset(
    [
        "email",
        "date",
        "time",
        "date-time",
        "duration",
        "ipv4",
        "ipv6",
        "hostname",
        "uuid",
        "uri",
        "uri-reference",
        "uri-template",
        "json-pointer",
        "relative-json-pointer",
    ]
)
# Dropped wherever they are, unless they ask for nothing (`_asks_nothing`). Keywords that
# constrain nothing by themselves (`then`, `else`, `minContains`, `maxContains`) are
# found through the one they need (`if`, `contains`). `unevaluatedProperties` and
# `unevaluatedItems` are not here: where the library drops them, the properties and items
# they would judge are never written (no additional ones unless the schema allows them,
# and then those count as evaluated), or another keyword of the node is found first.
DROPPED = {
    "not": "the grammar cannot exclude what a schema matches",
    "if": "conditional schemas (if/then/else) are not followed",
    "uniqueItems": "the grammar cannot compare the items of an array",
    "contains": "the grammar does not count the items that match a schema",
    "dependentRequired": "properties required by other properties are not followed",
    "dependentSchemas": "schemas applied by other properties are not followed",
    "dependencies": "properties required by other properties are not followed",
    "$dynamicRef": "dynamic references are not followed",
    "$recursiveRef": "dynamic references are not followed",
}
# A node with one of these is that keyword alone to the library: the node's other
# validation keywords are dropped (in this order of precedence).
RULING = ("$ref", "const", "enum", "anyOf", "oneOf", "allOf")
NUMBER_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
STRING_KEYWORDS = ("minLength", "maxLength", "pattern", "format")
# The keywords that constrain an instance (JSON Schema 2020-12's validation and
# applicator vocabularies, and draft 7's `dependencies`); the rest (title, description,
# default, examples, $defs, ...) are annotations, which no validator enforces.
VALIDATION = frozenset(
    [
        "type",
        "enum",
        "const",
        "multipleOf",
        "maximum",
        "exclusiveMaximum",
        "minimum",
        "exclusiveMinimum",
        "maxLength",
        "minLength",
        "pattern",
        "format",
        "maxItems",
        "minItems",
        "uniqueItems",
        "maxContains",
        "minContains",
        "maxProperties",
        "minProperties",
        "required",
        "dependentRequired",
        "properties",
        "patternProperties",
        "additionalProperties",
        "propertyNames",
        "items",
        "prefixItems",
        "additionalItems",
        "contains",
        "allOf",
        "anyOf",
        "oneOf",
        "not",
        "if",
        "then",
        "else",
        "dependentSchemas",
        "dependencies",
        "unevaluatedItems",
        "unevaluatedProperties",
        "$ref",
        "$dynamicRef",
        "$recursiveRef",
    ]
)
# Keywords whose value is a schema, a list of schemas, or a map of names to schemas.
_SCHEMA = frozenset(
    [
        "additionalProperties",
        "items",
        "additionalItems",
        "contains",
        "propertyNames",
        "not",
        "if",
        "then",
        "else",
        "unevaluatedItems",
        "unevaluatedProperties",
    ]
)
_SCHEMA_LISTS = frozenset(["prefixItems", "items", "anyOf", "oneOf", "allOf"])
_SCHEMA_MAPS = frozenset(
    ["properties", "patternProperties", "$defs", "definitions", "dependentSchemas"]
)


@dataclass(frozen=True)
class Unenforced:
    keyword: str
    pointer: str  # where it sits: a JSON Pointer into the schema, e.g. /properties/a/not
    why: str


def find_unenforced(schema: Any) -> Unenforced | None:
    """The first keyword of `schema` (in document order) that the grammar would not
    enforce, or None when the grammar holds the output to all of it."""
    # Each visited node keeps its parent's index and the tokens leading from it, so that
    # only the pointer of a finding is ever built.
    steps: list[tuple[int, tuple[str, ...]]] = [(-1, ())]
    stack: list[tuple[Any, int, bool]] = [(schema, 0, False)]
    while stack:
        node, index, names = stack.pop()
        if not isinstance(node, dict):
            continue
        found = _check(node, names)
        if found is not None:
            keyword, why = found
            return Unenforced(keyword, _pointer(steps, index, keyword), why)
        children = []
        for child, tokens in _subschemas(node):
            steps.append((index, tokens))
            children.append((child, len(steps) - 1, tokens == ("propertyNames",)))
        stack.extend(reversed(children))
    return None


def _pointer(steps: list[tuple[int, tuple[str, ...]]], index: int, keyword: str) -> str:
    tokens = [keyword]
    while index >= 0:
        index, leading = steps[index]
        tokens.extend(reversed(leading))
    return "".join("/" + _escape(t) for t in reversed(tokens))


def _check(node: dict[str, Any], names: bool) -> tuple[str, str] | None:
    """(keyword, why) of the node's first keyword the grammar would drop; `names`: the
    node is a `propertyNames` schema (it judges strings, with or without a `type`)."""
    for keyword, why in DROPPED.items():
        if keyword in node and not _asks_nothing(keyword, node):
            return (keyword, why)
    ref = node.get("$ref")
    if isinstance(ref, str) and ref != "#" and not ref.startswith("#/"):
        return ("$ref", "only references within the schema (#/...) are followed")
    for keyword, why in (
        ("oneOf", "it is taken as anyOf: an output may match more than one; use anyOf"),
        ("allOf", "only one of its schemas is followed"),
    ):
        if isinstance(node.get(keyword), list) and len(node[keyword]) > 1:
            return (keyword, why)
    ruling = next((k for k in RULING if k in node), None)
    if ruling is not None:
        for keyword in node:
            if keyword == ruling or keyword not in VALIDATION:
                continue
            if keyword == "type" and ruling in ("const", "enum") and _values_fit(node):
                continue
            return (keyword, f"the keywords beside {ruling} are not followed")
        return None
    types = _types(node) or ({"string"} if names else set())
    kinds = (
        (NUMBER_KEYWORDS, {"integer", "number"}, "a number"),
        (STRING_KEYWORDS, {"string"}, "a string"),
    )
    for keywords, applies_to, what in kinds:
        for keyword in keywords:
            if keyword not in node:
                continue
            if not types:  # the library follows them only under a `type`
                return (keyword, f"it needs the type of {what} beside it")
            if not types & applies_to:
                continue  # it does not apply to this node's type: nothing to enforce
            if keyword == "format" and not (
                isinstance(node["format"], str) and node["format"] in FORMATS
            ):
                return ("format", "the formats followed are " + ", ".join(sorted(FORMATS)))
            if keyword in ("minLength", "maxLength") and ("pattern" in node or "format" in node):
                return (keyword, "a length beside a pattern or format is not followed")
            if keyword == "pattern" and "format" in node:
                return (keyword, "a pattern beside a format is not followed")
            if keyword == "multipleOf" and not _whole_steps(node):
                return (
                    keyword,
                    "it is followed only on integers, by a whole number, with no minimum "
                    "or maximum beside it",
                )
    properties = node.get("properties")
    listed = properties if isinstance(properties, dict) else {}
    required = node.get("required")
    for name in required if isinstance(required, list) else ():
        if isinstance(name, str) and name not in listed:
            return ("required", f"{name!r} is not in properties: the grammar never writes it")
    if "propertyNames" in node and listed:
        return ("propertyNames", "the names in properties are not checked against it")
    return None


def _asks_nothing(keyword: str, node: dict[str, Any]) -> bool:
    """Whether the node's DROPPED `keyword` constrains nothing."""
    if keyword == "uniqueItems":
        return node[keyword] is False
    if keyword == "if":
        return "then" not in node and "else" not in node
    return False


def _values_fit(node: dict[str, Any]) -> bool:
    """Every value `const` or `enum` allows is of the node's `type`: the type says nothing
    more."""
    types = _types(node)
    values = [node["const"]] if "const" in node else node.get("enum")
    return isinstance(values, list) and all(_json_type(v) & types for v in values)


def _json_type(value: Any) -> set[str]:
    if value is None:
        return {"null"}
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return {"integer", "number"}
    if isinstance(value, float):
        return {"number"}
    if isinstance(value, str):
        return {"string"}
    return {"array"} if isinstance(value, list) else {"object"}


def _whole_steps(node: dict[str, Any]) -> bool:
    step = node["multipleOf"]
    integral = isinstance(step, int) or (isinstance(step, float) and step.is_integer())
    bounded = any(k in node for k in NUMBER_KEYWORDS if k != "multipleOf")
    return integral and "number" not in _types(node) and not bounded


def _types(node: dict[str, Any]) -> set[str]:
    """The node's `type`, as a set (empty if it has none, or not of strings)."""
    types = node.get("type")
    names = [types] if isinstance(types, str) else types if isinstance(types, list) else []
    return {t for t in names if isinstance(t, str)}


def _subschemas(node: dict[str, Any]) -> Iterator[tuple[Any, tuple[str, ...]]]:
    """The node's subschemas, each with the pointer tokens that lead to it."""
    for keyword, value in node.items():
        if keyword in _SCHEMA and isinstance(value, dict):
            yield value, (keyword,)
        elif keyword in _SCHEMA_LISTS and isinstance(value, list):
            yield from ((v, (keyword, str(i))) for i, v in enumerate(value))
        elif keyword in _SCHEMA_MAPS and isinstance(value, dict):
            yield from ((v, (keyword, str(k))) for k, v in value.items())


def _escape(token: str) -> str:
    """A JSON Pointer reference token (RFC 6901)."""
    return token.replace("~", "~0").replace("/", "~1")
