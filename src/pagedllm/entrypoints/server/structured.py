"""Structured output on the wire: the request fields that ask for it -> StructuredOutputs.

OpenAI's `response_format` (`text`, `json_object`, or `json_schema` with `{name, schema,
strict}`; on completions too, as vLLM takes it), and vLLM's extra fields: `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar`, or the newer `structured_outputs`
object; the Responses API's `text.format` (the same kinds, with `name`, `schema` and
`strict` beside `type`). One per request. `Structured.field` is the request's own
field, so that a grammar the engine cannot compile is a 400 naming what the client sent
(e.g. `response_format.json_schema`). With `strict: true` a schema keyword that the grammar
would not enforce (structured/unenforced.py) is a 400 naming it; without, it is accepted
and not enforced.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pagedllm.errors import UNSUPPORTED, InvalidParameterError
from pagedllm.sampling_params import KINDS, StructuredOutputs
from pagedllm.structured.unenforced import find_unenforced

RESPONSE_FORMATS = ("text", "json_object", "json_schema")
# vLLM's guided_* fields -> StructuredOutputs' fields
GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


@dataclass(frozen=True)
class Structured:
    spec: StructuredOutputs
    field: str  # the request's field that asked for it

    def param_names(self) -> dict[str, str]:
        """Engine parameters -> the request's field, for error objects."""
        names = {"structured_outputs": self.field}
        names.update({f"structured_outputs.{kind}": self.field for kind in KINDS})
        return names


def from_fields(
    guided: Mapping[str, Any],
    structured_outputs: dict[str, Any] | None,
    response_format: dict[str, Any] | None = None,
    text_format: dict[str, Any] | None = None,
) -> Structured | None:
    """The request's structured output, if it asks for one; InvalidParameterError names
    the field that is wrong, or the second of two that both ask."""
    found: list[Structured] = []
    if response_format is not None:
        found += _format(response_format, "response_format", "json_schema")
    if text_format is not None:
        found += _format(text_format, "text.format", None)
    for name, kind in GUIDED.items():
        if guided.get(name) is not None:
            found.append(Structured(_spec(name, **{kind: guided[name]}), name))
    if structured_outputs is not None:
        spec = _spec("structured_outputs", **structured_outputs)
        found.append(Structured(spec, f"structured_outputs.{spec.kind}"))
    if len(found) > 1:
        first, second = found[0].field, found[1].field
        raise InvalidParameterError(
            second, f"{second}: only one structured output per request ({first} asks already)"
        )
    return found[0] if found else None


def _format(rf: dict[str, Any], where: str, schema_key: str | None) -> list[Structured]:
    """`response_format` (`where`), whose json_schema sits under `schema_key`, or the
    Responses API's `text.format`, which holds it beside `type` (`schema_key` None)."""
    kind = rf.get("type", "text")
    if kind not in RESPONSE_FORMATS:
        raise InvalidParameterError(
            f"{where}.type",
            f"{where}.type must be one of {', '.join(RESPONSE_FORMATS)}, got {kind!r}",
        )
    if kind == "text":
        return []
    if kind == "json_object":
        return [Structured(StructuredOutputs(json_object=True), where)]
    field = f"{where}.{schema_key}" if schema_key else where
    js = rf.get(schema_key) if schema_key else rf
    if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
        raise InvalidParameterError(
            field, f"{field} must be an object with a 'schema' (a JSON schema object)"
        )
    schema, strict = js["schema"], js.get("strict")
    if strict is not None and not isinstance(strict, bool):
        got = {str: "a string", list: "an array", dict: "an object"}.get(type(strict), "a number")
        raise InvalidParameterError(
            f"{field}.strict", f"{field}.strict must be true or false, got {got}"
        )
    if strict:
        check_enforced(schema, field)
    return [Structured(_spec(field, json=schema), field)]


def check_enforced(schema: dict[str, Any], field: str) -> None:
    """InvalidParameterError naming `field` if the grammar would not enforce all of
    `schema` (strict output asked for)."""
    found = find_unenforced(schema)
    if found is not None:
        raise InvalidParameterError(
            field,
            f"{field}: with strict true, every keyword must hold, but {found.keyword!r} at "
            f"{found.pointer} would not ({found.why}); remove it, or set strict to false "
            "to accept the schema without it",
            UNSUPPORTED,
        )


def _spec(field: str, **fields: Any) -> StructuredOutputs:
    """StructuredOutputs of `fields`; its errors name the request's `field`."""
    try:
        return StructuredOutputs(**fields)
    except TypeError:
        raise InvalidParameterError(
            field, f"{field} takes the fields {', '.join(KINDS)}, got {sorted(fields)}"
        ) from None
    except InvalidParameterError as exc:
        if field == "structured_outputs":
            raise
        raise InvalidParameterError(field, f"{field}: {exc}", exc.code) from None
