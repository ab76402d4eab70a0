"""Structured output through the server, with the official `openai` client: chat's
response_format (json_object, json_schema, and the client's `parse` with a pydantic
model), vLLM's guided_* and structured_outputs fields on both endpoints, streamed and
whole. The tiny random model's output parses only because the grammar held it. A grammar
the server cannot compile is a 400 naming the client's field."""

from __future__ import annotations

import json
import re
from typing import Any, Literal

import httpx
import jsonschema
from pydantic import BaseModel, Field

from inspect_internals import num_compiles
from live_server import CHAT, NAME, LiveServer, check_error


class Answer(BaseModel):
    city: Literal["Paris", "Rome", "Oslo"]
    rating: int = Field(ge=1, le=5)
    tags: list[Literal["old", "big", "cold"]] = Field(max_length=2)
    note: str = Field(max_length=8)


SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "word": {"type": "string", "pattern": "^[a-z]{1,5}$"},
    },
    "required": ["ok", "count", "word"],
    "additionalProperties": False,
}


def post(server: LiveServer, path: str, **body: Any) -> httpx.Response:
    if path == "chat/completions":
        body.setdefault("messages", CHAT)
    else:
        body.setdefault("prompt", "Hi")
    return httpx.post(f"{server.url}/v1/{path}", json={"model": NAME, **body})


def test_parse_with_a_pydantic_model(server: LiveServer) -> None:
    client = server.client()
    for seed in range(3):
        completion = client.chat.completions.parse(
            model=NAME,
            messages=CHAT,  # type: ignore[arg-type]
            response_format=Answer,
            max_completion_tokens=80,
            seed=seed,
        )
        choice = completion.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Answer), choice.message.content
        # in the schema's order, as OpenAI answers
        assert list(json.loads(choice.message.content or "")) == list(Answer.model_fields)
    # Compiled once, off the engine's and the tokenizer's threads: the engine found it cached.
    compiler = server.engine.engine.grammars.compiler
    assert num_compiles(compiler) == 1
    (thread,) = compiler.compiles_by_thread
    assert thread.startswith("pagedllm-grammar-wait_")
    server.assert_pool_whole()


def test_json_schema_and_json_object_on_chat(server: LiveServer) -> None:
    client = server.client()
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA, "strict": True}}
    r = client.chat.completions.create(
        model=NAME,
        messages=CHAT,  # type: ignore[arg-type]
        response_format=fmt,  # type: ignore[arg-type]
        max_completion_tokens=60,
        n=3,
        seed=4,
    )
    for choice in r.choices:
        jsonschema.validate(json.loads(choice.message.content or ""), SCHEMA)
    # Streamed: the deltas add up to a valid document.
    stream = client.chat.completions.create(
        model=NAME,
        messages=CHAT,  # type: ignore[arg-type]
        response_format=fmt,  # type: ignore[arg-type]
        max_completion_tokens=60,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)
    # Any object; `}` favoured, so that the random model closes it at once.
    close = server.engine.engine.tokenizer.convert_tokens_to_ids("}")
    r = client.chat.completions.create(
        model=NAME,
        messages=CHAT,  # type: ignore[arg-type]
        response_format={"type": "json_object"},
        max_completion_tokens=40,
        temperature=0,
        logit_bias={str(close): 30},
    )
    assert isinstance(json.loads(r.choices[0].message.content or ""), dict)
    assert r.choices[0].finish_reason == "stop"
    server.assert_pool_whole()


def test_vllm_fields_on_both_endpoints(server: LiveServer) -> None:
    client = server.client()
    regex = r"[0-9]{2}-[a-c]{3}"
    r = client.completions.create(
        model=NAME, prompt="Hi", max_tokens=20, n=2, extra_body={"guided_regex": regex}
    )
    assert all(re.fullmatch(regex, c.text) for c in r.choices), r.choices
    r = client.completions.create(
        model=NAME,
        prompt="Hi",
        max_tokens=20,
        extra_body={"structured_outputs": {"choice": ["red", "blue"]}},
    )
    assert r.choices[0].text in ("red", "blue")
    r = client.completions.create(
        model=NAME, prompt="Hi", max_tokens=60, extra_body={"guided_json": SCHEMA}
    )
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)
    c = client.chat.completions.create(
        model=NAME,
        messages=CHAT,  # type: ignore[arg-type]
        max_completion_tokens=20,
        extra_body={"guided_choice": ["yes", "no"]},
    )
    assert c.choices[0].message.content in ("yes", "no")
    c = client.chat.completions.create(
        model=NAME,
        messages=CHAT,  # type: ignore[arg-type]
        max_completion_tokens=20,
        extra_body={"guided_grammar": 'root ::= "a" [0-9] "z"'},
    )
    assert re.fullmatch("a[0-9]z", c.choices[0].message.content or "")
    server.assert_pool_whole()


def test_a_bad_grammar_is_a_400_naming_the_field(server: LiveServer) -> None:
    bad_schema = {"type": "json_schema", "json_schema": {"name": "t", "schema": {"type": "zzz"}}}
    chat, cmpl = "chat/completions", "completions"
    for path, body, param in [
        (chat, {"response_format": bad_schema}, "response_format.json_schema"),
        (chat, {"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (chat, {"response_format": {"type": "xml"}}, "response_format.type"),
        (cmpl, {"guided_regex": "(unclosed"}, "guided_regex"),
        (cmpl, {"guided_json": "{not json"}, "guided_json"),
        (cmpl, {"guided_choice": []}, "guided_choice"),
        (cmpl, {"guided_grammar": "root ::= "}, "guided_grammar"),
        (cmpl, {"structured_outputs": {"regex": "(x"}}, "structured_outputs.regex"),
        (cmpl, {"structured_outputs": {"rgx": "x"}}, "structured_outputs"),
        (chat, {"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        (chat, {"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ]:
        error = check_error(post(server, path, max_tokens=5, **body), 400, param=param)
        assert ".cc:" not in error["message"], error
    # The same bad grammar again: refused from the cache, still naming the field.
    error = check_error(
        post(server, chat, response_format=bad_schema), 400, param="response_format.json_schema"
    )
    assert error["message"].startswith("response_format.json_schema")
    server.assert_pool_whole()


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Oslo"]},
                "unit": {"enum": ["C", "F"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


def check_calls(calls: Any, names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def with_tools(server: LiveServer, choice: Any, tokens: int, **options: Any) -> Any:
    """A chat completion through the openai client, with both tools."""
    return server.client().chat.completions.create(
        model=NAME,
        messages=CHAT,  # type: ignore[arg-type]
        tools=[WEATHER, TIME],  # type: ignore[list-item]
        tool_choice=choice,
        max_completion_tokens=tokens,
        **options,
    )


def test_tool_choice_named_and_required(server: LiveServer) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice, names in [(named, {"get_time"}), ("required", {"get_weather", "get_time"})]:
        for seed in range(2):
            r = with_tools(server, choice, 120, seed=seed)
            (c,) = r.choices
            assert c.finish_reason == "tool_calls" and c.message.content is None
            check_calls(c.message.tool_calls, names)
            if choice is named:
                assert len(c.message.tool_calls or []) == 1
    # Streamed: the named call opens at once and its arguments arrive in pieces.
    stream = with_tools(server, named, 60, stream=True)
    chunks = [c for c in stream if c.choices]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or ()]
    assert len(deltas) > 2 and deltas[0].id and all(d.index == 0 for d in deltas)
    assert deltas[0].function and deltas[0].function.name == "get_time"
    assert all(d.id is None and d.function and d.function.name is None for d in deltas[1:])
    arguments = "".join((d.function.arguments or "") if d.function else "" for d in deltas)
    jsonschema.validate(json.loads(arguments), PARAMETERS["get_time"])
    # "none": the tools are ignored.
    r = with_tools(server, "none", 5)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"
    server.assert_pool_whole()


def test_tool_errors_name_the_field(server: LiveServer) -> None:
    chat = "chat/completions"
    bad_params = {"type": "function", "function": {"name": "f", "parameters": {"type": "zzz"}}}
    named_f = {"type": "function", "function": {"name": "f"}}
    for body, param, code in [
        ({"tool_choice": "required"}, "tool_choice", None),
        ({"tools": [WEATHER], "tool_choice": named_f}, "tool_choice.function.name", None),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", None),
        ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools[0]", None),
        ({"tools": [bad_params], "tool_choice": named_f}, "tools[0].function.parameters", None),
        (
            {"tools": [WEATHER, {**WEATHER}], "tool_choice": "required"},
            "tools[1].function.name",
            None,
        ),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "response_format",
            None,
        ),
    ]:
        check_error(post(server, chat, max_tokens=5, **body), 400, param=param, code=code)
    server.assert_pool_whole()


def test_response_format_on_completions(server: LiveServer) -> None:
    """As vLLM: json_schema and json_object hold a completion's text too; text is plain."""
    client = server.client()
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA, "strict": True}}
    r = client.completions.create(
        model=NAME, prompt="Hi", max_tokens=60, n=2, extra_body={"response_format": fmt}
    )
    for choice in r.choices:
        jsonschema.validate(json.loads(choice.text), SCHEMA)
    empty = server.engine.engine.tokenizer.convert_tokens_to_ids("{}")  # favoured: short
    r = client.completions.create(
        model=NAME,
        prompt="Hi",
        max_tokens=40,
        temperature=0,
        logit_bias={str(empty): 30},
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert json.loads(r.choices[0].text) == {} and r.choices[0].finish_reason == "stop"
    r = client.completions.create(
        model=NAME, prompt="Hi", max_tokens=5, extra_body={"response_format": {"type": "text"}}
    )
    assert r.choices[0].finish_reason == "length"
    check_error(
        post(server, "completions", response_format={"type": "xml"}),
        400,
        param="response_format.type",
    )
    check_error(
        post(server, "completions", response_format={"type": "json_object"}, guided_regex="a"),
        400,
        param="guided_regex",
    )
    server.assert_pool_whole()


TAGS = {"type": "array", "items": {"type": "integer"}, "maxItems": 3}
# (schema, the keyword the grammar would drop, its pointer)
UNENFORCED = [
    ({"type": "string", "format": "regex"}, "format", "/format"),
    (
        {"type": "object", "properties": {"tags": {**TAGS, "uniqueItems": True}}},
        "uniqueItems",
        "/properties/tags/uniqueItems",
    ),
    ({"type": "integer", "if": {"minimum": 5}, "then": {"multipleOf": 2}}, "if", "/if"),
    ({"type": "integer", "not": {"const": 3}}, "not", "/not"),
    ({"$ref": "https://example.com/schema.json"}, "$ref", "/$ref"),
]


def test_strict_refuses_keywords_the_grammar_would_not_enforce(server: LiveServer) -> None:
    for path in ("chat/completions", "completions"):
        for schema, keyword, pointer in UNENFORCED:
            strict = {"name": "t", "schema": schema, "strict": True}
            fmt = {"type": "json_schema", "json_schema": strict}
            error = check_error(
                post(server, path, max_tokens=20, response_format=fmt),
                400,
                param="response_format.json_schema",
                code="unsupported_parameter",
                words=(repr(keyword), f" at {pointer} ", "strict"),
            )
            assert error["message"].startswith("response_format.json_schema: ")
            # Without strict the schema is taken, the keyword not enforced (docs say so).
            lax = {"type": "json_schema", "json_schema": {**strict, "strict": False}}
            assert post(server, path, max_tokens=20, response_format=lax).status_code == 200
        # What the grammar holds passes under strict.
        held = {"type": "object", "properties": {"tags": TAGS}, "required": ["tags"]}
        fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": held, "strict": True}}
        assert post(server, path, max_tokens=20, response_format=fmt).status_code == 200
    server.assert_pool_whole()


def test_json_schema_strict_must_be_a_boolean(server: LiveServer) -> None:
    for strict in ("yes", 1, [True]):
        fmt = {
            "type": "json_schema",
            "json_schema": {"name": "t", "schema": SCHEMA, "strict": strict},
        }
        for path in ("chat/completions", "completions"):
            check_error(
                post(server, path, max_tokens=5, response_format=fmt),
                400,
                param="response_format.json_schema.strict",
                words=("true or false",),
            )
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA, "strict": None}}
    assert post(server, "chat/completions", max_tokens=5, response_format=fmt).status_code == 200
    server.assert_pool_whole()
