"""The JSON-schema keywords the grammar library compiles without enforcing
(structured/unenforced.py), each measured: the schema compiles as the engine compiles it,
its grammar accepts an instance that the schema forbids (jsonschema says so), and
`find_unenforced` names that keyword and where it sits. The keywords it lets through are
measured the other way: the grammar refuses the forbidden instance. When the library
changes, these tests say which rule to drop or add."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
import xgrammar as xgr
from referencing import Registry
from referencing.jsonschema import DRAFT202012
from xgrammar.testing import _is_grammar_accept_string

from pagedllm.structured.unenforced import find_unenforced

INT = {"type": "integer"}
# (schema, an instance it forbids, the keyword found, its pointer)
UNENFORCED: list[tuple[dict[str, Any], Any, str, str]] = [
    ({"type": "integer", "not": {"const": 3}}, 3, "not", "/not"),
    (
        {
            "type": "object",
            "properties": {"a": INT, "b": INT},
            "if": {"properties": {"a": {"const": 1}}},
            "then": {"required": ["b"]},
        },
        {"a": 1},
        "if",
        "/if",
    ),
    (
        {
            "type": "object",
            "properties": {"tags": {"type": "array", "items": INT, "uniqueItems": True}},
            "required": ["tags"],
        },
        {"tags": [1, 1]},
        "uniqueItems",
        "/properties/tags/uniqueItems",
    ),
    ({"$ref": "https://example.com/int.json"}, "x", "$ref", "/$ref"),
    ({"$defs": {"a": {"$anchor": "A", "type": "integer"}}, "$ref": "#A"}, "x", "$ref", "/$ref"),
    ({"type": "string", "format": "regex"}, "(", "format", "/format"),
    ({"type": "array", "items": INT, "contains": {"const": 5}}, [1], "contains", "/contains"),
    (
        {"type": "object", "properties": {"a": INT, "b": INT}, "dependentRequired": {"a": ["b"]}},
        {"a": 1},
        "dependentRequired",
        "/dependentRequired",
    ),
    (
        {"type": "object", "properties": {"a": INT, "b": INT}, "dependencies": {"a": ["b"]}},
        {"a": 1},
        "dependencies",
        "/dependencies",
    ),
    (
        {"$defs": {"i": {"$dynamicAnchor": "x", "type": "integer"}}, "$dynamicRef": "#/$defs/i"},
        "x",
        "$dynamicRef",
        "/$dynamicRef",
    ),
    (
        {"$recursiveAnchor": True, "type": "object", "properties": {"a": {"$recursiveRef": "#"}}},
        {"a": 1},
        "$recursiveRef",
        "/properties/a/$recursiveRef",
    ),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, 1, "oneOf", "/oneOf"),
    ({"allOf": [{"type": "integer", "minimum": 5}, INT]}, 3, "allOf", "/allOf"),
    ({"$defs": {"a": INT}, "$ref": "#/$defs/a", "minimum": 5}, 3, "minimum", "/minimum"),
    ({"type": "integer", "anyOf": [{"minimum": 5}]}, 3, "type", "/type"),
    ({"type": "string", "enum": ["a", "bb"], "maxLength": 1}, "bb", "maxLength", "/maxLength"),
    ({"type": ["string", "null"], "enum": ["a", None, 1]}, 1, "type", "/type"),
    ({"minimum": 5}, 3, "minimum", "/minimum"),
    ({"type": "string", "pattern": "^a*$", "maxLength": 2}, "aaaa", "maxLength", "/maxLength"),
    (
        {"type": "string", "format": "email", "maxLength": 6},
        "abc@def.gh",
        "maxLength",
        "/maxLength",
    ),
    ({"type": "string", "pattern": "^a", "format": "email"}, "b@c.de", "pattern", "/pattern"),
    ({"type": "number", "multipleOf": 0.5}, 0.3, "multipleOf", "/multipleOf"),
    ({"type": "integer", "multipleOf": 5, "minimum": 0}, 3, "multipleOf", "/multipleOf"),
    (
        {
            "type": "object",
            "properties": {"a": INT},
            "required": ["b"],
            "additionalProperties": INT,
        },
        {"a": 1},
        "required",
        "/required",
    ),
    (
        {"type": "object", "properties": {"b": INT}, "propertyNames": {"pattern": "^a"}},
        {"b": 1},
        "propertyNames",
        "/propertyNames",
    ),
    (
        {"type": "object", "properties": {"a/b~": {"type": "integer", "not": {"const": 1}}}},
        {"a/b~": 1},
        "not",
        "/properties/a~1b~0/not",
    ),
]
# (schema, an instance it forbids): kept by the grammar, so let through.
ENFORCED: list[tuple[dict[str, Any], Any]] = [
    ({"type": "string", "format": "email"}, "not-an-email"),
    ({"type": "string", "format": "date"}, "yesterday"),
    ({"type": "string", "pattern": "^[a-z]{1,5}$"}, "abcdef"),
    ({"type": "string", "minLength": 2, "maxLength": 3}, "a"),
    ({"type": ["string", "null"], "minLength": 2}, "a"),
    ({"type": "string", "enum": ["a", "b"]}, "c"),
    ({"type": "string", "const": "a"}, "b"),
    ({"type": "integer", "multipleOf": 5}, 3),
    ({"type": "number", "minimum": 5.5, "exclusiveMaximum": 9}, 9),
    ({"type": "array", "items": INT, "minItems": 1, "maxItems": 2}, [1, 2, 3]),
    ({"type": "array", "prefixItems": [INT], "items": False}, [1, 2]),
    ({"type": "object", "properties": {"a": INT, "b": INT}, "minProperties": 1}, {}),
    ({"type": "object", "patternProperties": {"^a": INT}}, {"a": "x"}),
    ({"type": "object", "additionalProperties": INT, "propertyNames": {"pattern": "^a"}}, {"b": 1}),
    ({"type": "object", "properties": {"a": INT}, "unevaluatedProperties": False}, {"b": 1}),
    ({"type": "integer", "if": {"const": 1}, "maximum": 5}, 6),
    ({"$defs": {"a": INT}, "$ref": "#/$defs/a", "description": "an integer"}, "x"),
    ({"anyOf": [{"type": "string", "maxLength": 2}, {"type": "null"}], "default": None}, "abc"),
    ({"allOf": [{"type": "integer", "minimum": 5}]}, 3),
    ({"type": "array", "items": INT, "uniqueItems": False}, ["x"]),
]


def grammar_accepts(schema: dict[str, Any], instance: Any) -> bool:
    """Whether the engine's grammar for `schema` (structured/grammar.py's options:
    compact JSON, strict mode) accepts `instance`, written as the grammar writes JSON."""
    grammar = xgr.Grammar.from_json_schema(
        json.dumps(schema), any_whitespace=False, strict_mode=True
    )
    return _is_grammar_accept_string(grammar, json.dumps(instance))


# The draft that has the keyword; the remote $ref's schema, served locally.
DRAFTS = {
    "dependencies": jsonschema.Draft7Validator,
    "$recursiveAnchor": jsonschema.Draft201909Validator,
}
REMOTE = Registry().with_resource(
    "https://example.com/int.json", DRAFT202012.create_resource({"type": "integer"})
)


def schema_allows(schema: dict[str, Any], instance: Any) -> bool:
    drafts = [v for k, v in DRAFTS.items() if k in schema]
    validator = drafts[0] if drafts else jsonschema.Draft202012Validator
    check = validator(schema, format_checker=validator.FORMAT_CHECKER, registry=REMOTE)
    return check.is_valid(instance)


@pytest.mark.parametrize(("schema", "instance", "keyword", "pointer"), UNENFORCED)
def test_each_keyword_the_grammar_drops_is_found(
    schema: dict[str, Any], instance: Any, keyword: str, pointer: str
) -> None:
    assert not schema_allows(schema, instance)
    assert grammar_accepts(schema, instance), "the library enforces it now: drop the rule"
    found = find_unenforced(schema)
    assert found is not None and (found.keyword, found.pointer) == (keyword, pointer), found


@pytest.mark.parametrize(("schema", "instance"), ENFORCED)
def test_keywords_the_grammar_keeps_are_let_through(schema: dict[str, Any], instance: Any) -> None:
    assert not schema_allows(schema, instance)
    assert not grammar_accepts(schema, instance)
    assert find_unenforced(schema) is None


def test_a_deep_or_malformed_schema_is_walked_without_failing() -> None:
    deep: dict[str, Any] = {"type": "array"}
    node = deep
    for _ in range(50_000):  # deeper than any parsed JSON: the walk does not recurse
        node["items"] = node = {"type": "array"}
    node["uniqueItems"] = True
    found = find_unenforced(deep)
    assert found is not None and found.pointer == "/items" * 50_000 + "/uniqueItems"
    for odd in ({"type": 5, "required": "ab"}, {"type": [{}], "format": ["x"]}, {"enum": {}}):
        find_unenforced(odd)  # any answer, no exception: the compile judges such schemas
