"""Tool calling through the server, with the official `openai` client: tool_choice "auto"
(the model's `<tool_call>` blocks parsed from its text, content deltas before a call,
a malformed call left as text), the client's `parse` helper with a pydantic tool,
tool history in the prompt (assistant tool_calls and `tool` results), and the prompt
the tools make. The tiny random model writes a call only where a grammar holds it to
one, so "auto" is driven here by a vLLM guided_regex over the Hermes format."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import xgrammar as xgr
from pydantic import BaseModel, Field
from xgrammar.testing import _is_grammar_accept_string

from live_server import CHAT, NAME, LiveServer, check_error
from pagedllm.entrypoints.server.chat_template import encode_chat
from pagedllm.entrypoints.server.tools import tool_use

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
CALL = (
    r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Oslo|Rome)"\}\}\n</tool_call>'
)


def auto(server: LiveServer, regex: str | None, **options: Any) -> Any:
    """A chat completion with both tools and tool_choice "auto", held to `regex`."""
    extra = {"guided_regex": regex} if regex else {}
    return server.client().chat.completions.create(
        model=NAME,
        messages=CHAT,  # type: ignore[arg-type]
        tools=[WEATHER, TIME],  # type: ignore[list-item]
        extra_body=extra,
        **{"max_completion_tokens": 60, **options},
    )


def test_auto_parses_calls_and_keeps_text(server: LiveServer) -> None:
    r = auto(server, f"Sure\\. {CALL}")
    (choice,) = r.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Sure."
    (call,) = choice.message.tool_calls or []
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Oslo", "Rome")
    # The tools reached the prompt: SmolLM2's template has no `tools`, so the Hermes
    # system block carries them.
    tokenizer = server.engine.engine.tokenizer
    prompt = encode_chat(tokenizer, CHAT, tools=[WEATHER, TIME])
    assert r.usage and r.usage.prompt_tokens == len(prompt)
    assert '"name": "get_time"' in tokenizer.decode(prompt)
    # Streamed: the text before the call as content deltas, then the call whole.
    chunks = [c for c in auto(server, f"Sure\\. {CALL}", stream=True) if c.choices]
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert content == "Sure. "  # a stream cannot take back the space before the call
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or ()]
    (delta,) = deltas
    assert delta.index == 0 and delta.id and delta.type == "function"
    assert delta.function and delta.function.name == "get_weather"
    assert json.loads(delta.function.arguments or "")["city"] in ("Oslo", "Rome")
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # Two calls, text between: both parsed.
    r = auto(server, f"{CALL}\\nand {CALL}", max_completion_tokens=150)
    assert r.choices[0].finish_reason == "tool_calls", r.choices[0].message.content
    assert [c.function.name for c in r.choices[0].message.tool_calls or []] == ["get_weather"] * 2
    assert r.choices[0].message.content == "and"
    server.assert_pool_whole()


def test_auto_without_a_call_or_with_a_bad_one_is_text(server: LiveServer) -> None:
    # The random model writes no call: its text is the content, cut by max tokens.
    r = auto(server, None, max_completion_tokens=8)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"
    assert r.choices[0].message.content
    # A block whose JSON does not parse, or that names a function not offered, stays text.
    for bad in (
        r'<tool_call>\{"name": "get_weather", "arguments": \{"city": </tool_call>',
        r'<tool_call>\{"name": "rm", "arguments": \{\}\}</tool_call>',
    ):
        for stream in (False, True):
            if stream:
                chunks = [c for c in auto(server, f"x {bad}", stream=True) if c.choices]
                assert not any(c.choices[0].delta.tool_calls for c in chunks)
                text = "".join(c.choices[0].delta.content or "" for c in chunks)
                finish = chunks[-1].choices[0].finish_reason
            else:
                message = auto(server, f"x {bad}").choices[0]
                assert message.message.tool_calls is None
                text, finish = message.message.content or "", message.finish_reason
            assert finish == "stop" and text == "x " + bad.replace("\\", "")
    server.assert_pool_whole()


class Lookup(BaseModel):
    """Look a word up."""

    word: str = Field(pattern="^[a-z]{1,6}$")
    limit: int = Field(ge=1, le=3)


def test_parse_helper_with_a_pydantic_tool(server: LiveServer) -> None:
    client = server.client()
    tool = openai.pydantic_function_tool(Lookup)
    completion = client.chat.completions.parse(
        model=NAME,
        messages=CHAT,  # type: ignore[arg-type]
        tools=[tool],
        tool_choice={"type": "function", "function": {"name": "Lookup"}},
        max_completion_tokens=40,
        seed=1,
    )
    (call,) = completion.choices[0].message.tool_calls or []
    assert isinstance(call.function.parsed_arguments, Lookup)
    # The streaming helper assembles the same call from its deltas.
    with client.chat.completions.stream(
        model=NAME,
        messages=CHAT,  # type: ignore[arg-type]
        tools=[tool],
        tool_choice={"type": "function", "function": {"name": "Lookup"}},
        max_completion_tokens=40,
        seed=1,
    ) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_completion()
    assert "tool_calls.function.arguments.delta" in events
    (streamed,) = final.choices[0].message.tool_calls or []
    assert streamed.function.parsed_arguments == call.function.parsed_arguments
    assert final.choices[0].finish_reason == "tool_calls"
    server.assert_pool_whole()


HISTORY: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather in Oslo?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "-3 C, snow"},
]


def test_tool_history_reaches_the_template(server: LiveServer) -> None:
    r = server.client().chat.completions.create(
        model=NAME,
        messages=HISTORY,  # type: ignore[arg-type]
        tools=[WEATHER],  # type: ignore[list-item]
        max_completion_tokens=4,
    )
    history = [dict(m) for m in HISTORY]
    history[1] = {**history[1], "content": ""}
    history[1]["tool_calls"] = [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Oslo"}},
        }
    ]
    tokenizer = server.engine.engine.tokenizer
    prompt = encode_chat(tokenizer, history, tools=[WEATHER])
    assert r.usage and r.usage.prompt_tokens == len(prompt)
    text = tokenizer.decode(prompt)
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    )
    assert "<|im_start|>user\n<tool_response>\n-3 C, snow\n</tool_response><|im_end|>" in text
    # tool_choice "none": the tools are not offered (the prompt is the history alone).
    r = server.client().chat.completions.create(
        model=NAME,
        messages=HISTORY,  # type: ignore[arg-type]
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="none",
        max_completion_tokens=4,
    )
    assert r.usage and r.usage.prompt_tokens == len(encode_chat(tokenizer, history))
    server.assert_pool_whole()


def test_bad_tool_history_names_the_field(server: LiveServer) -> None:
    def call(**fields: Any) -> dict[str, Any]:
        fn = {"name": "get_weather", "arguments": "{}"} | fields.pop("function", {})
        return {"id": "c", "type": "function", "function": fn} | fields

    def assistant(*calls: Any) -> list[dict[str, Any]]:
        return [{"role": "user", "content": "Hi"}, {"role": "assistant", "tool_calls": list(calls)}]

    for messages, param in [
        (
            assistant(call(function={"arguments": "{not json"})),
            "messages[1].tool_calls[0].function.arguments",
        ),
        (
            assistant(call(function={"arguments": "[1]"})),
            "messages[1].tool_calls[0].function.arguments",
        ),
        (assistant(call(), call(id=7)), "messages[1].tool_calls[1].id"),
        (assistant(call(type="web")), "messages[1].tool_calls[0]"),
        (assistant(call(function={"name": None})), "messages[1].tool_calls[0].function"),
        (
            [{"role": "user", "content": "Hi"}, {"role": "assistant", "tool_calls": {}}],
            "messages[1].tool_calls",
        ),
        ([{"role": "user", "content": "x", "tool_calls": [call()]}], "messages[0].tool_calls"),
        ([{"role": "tool", "content": "x"}], "messages[0].tool_call_id"),
        ([{"role": "assistant", "content": None}], "messages[0].content"),
    ]:
        r = httpx.post(
            f"{server.url}/v1/chat/completions",
            json={"model": NAME, "messages": messages, "max_tokens": 2},
        )
        check_error(r, 400, param=param)
    server.assert_pool_whole()


def chat(server: LiveServer, **body: Any) -> httpx.Response:
    body.setdefault("messages", CHAT)
    return httpx.post(
        f"{server.url}/v1/chat/completions", json={"model": NAME, "max_tokens": 2, **body}
    )


def test_parallel_tool_calls_false_gives_at_most_one_call(server: LiveServer) -> None:
    two = f"{CALL}\\nand {CALL}"
    r = auto(server, two, max_completion_tokens=150, parallel_tool_calls=False)
    (choice,) = r.choices
    assert choice.finish_reason == "tool_calls"
    assert len(choice.message.tool_calls or []) == 1, choice.message.tool_calls
    assert choice.message.content == "and"  # the dropped call is not sent as text either
    stream = auto(server, two, max_completion_tokens=150, parallel_tool_calls=False, stream=True)
    chunks = [c for c in stream if c.choices]
    assert len([d for c in chunks for d in c.choices[0].delta.tool_calls or ()]) == 1
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    r = auto(server, two, max_completion_tokens=150, parallel_tool_calls=True)
    assert len(r.choices[0].message.tool_calls or []) == 2
    # "required": the grammar holds the output to an array of one call.
    for seed in range(2):
        r = server.client().chat.completions.create(
            model=NAME,
            messages=CHAT,  # type: ignore[arg-type]
            tools=[WEATHER, TIME],  # type: ignore[list-item]
            tool_choice="required",
            parallel_tool_calls=False,
            max_completion_tokens=80,
            seed=seed,
        )
        assert r.choices[0].finish_reason == "tool_calls"
        assert len(r.choices[0].message.tool_calls or []) == 1
    check_error(
        chat(server, tools=[WEATHER], parallel_tool_calls="no"), 400, param="parallel_tool_calls"
    )
    server.assert_pool_whole()


def test_required_without_parallel_calls_has_a_one_call_grammar() -> None:
    def accepts(schema: dict[str, Any], calls: list[dict[str, Any]]) -> bool:
        grammar = xgr.Grammar.from_json_schema(
            json.dumps(schema), any_whitespace=False, strict_mode=True
        )
        return _is_grammar_accept_string(grammar, json.dumps(calls))

    one = [{"name": "get_time", "parameters": {}}]
    single = tool_use([WEATHER, TIME], "required", parallel_tool_calls=False)
    several = tool_use([WEATHER, TIME], "required")
    assert single is not None and several is not None
    assert single.schema is not None and several.schema is not None
    assert accepts(single.schema, one) and not accepts(single.schema, one * 2)
    assert accepts(several.schema, one * 2)


def test_tool_parameters_must_be_an_object_schema(server: LiveServer) -> None:
    named = {"type": "function", "function": {"name": "f"}}
    for parameters in (
        {"type": "string"},
        {"type": "array", "items": {"type": "integer"}},
        {"properties": {"a": {"type": "string"}}},
        ["x"],
    ):
        tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
        for choice in (named, "auto", "required", "none"):
            check_error(
                chat(server, tools=[WEATHER, tool], tool_choice=choice),
                400,
                param="tools[1].function.parameters",
                words=('"type": "object"',),
            )
    server.assert_pool_whole()


def test_a_tool_result_must_answer_an_earlier_call(server: LiveServer) -> None:
    user, assistant, result = HISTORY
    other = {**result, "tool_call_id": "call_2"}
    for messages, param in [
        ([user, assistant, other], "messages[2].tool_call_id"),
        ([user, result, assistant], "messages[1].tool_call_id"),
        ([user, result], "messages[1].tool_call_id"),
        ([user, assistant, result, other], "messages[3].tool_call_id"),
    ]:
        check_error(chat(server, messages=messages), 400, param=param, words=("answers no",))
    assert chat(server, messages=HISTORY).status_code == 200
    server.assert_pool_whole()


def test_a_strict_tool_refuses_keywords_the_grammar_would_not_enforce(server: LiveServer) -> None:
    tags = {"type": "array", "items": {"type": "integer"}, "maxItems": 3, "uniqueItems": True}
    parameters = {"type": "object", "properties": {"tags": tags}, "required": ["tags"]}
    named = {"type": "function", "function": {"name": "f"}}

    def tool(strict: Any) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {"name": "f", "parameters": parameters, "strict": strict},
        }

    for choice in (named, "required"):
        check_error(
            chat(server, tools=[TIME, tool(True)], tool_choice=choice),
            400,
            param="tools[1].function.parameters",
            words=("'uniqueItems' at /properties/tags/uniqueItems",),
        )
        assert chat(server, tools=[TIME, tool(False)], tool_choice=choice).status_code == 200
    # Under "auto" no grammar holds the arguments: nothing to refuse.
    assert chat(server, tools=[TIME, tool(True)]).status_code == 200
    check_error(chat(server, tools=[tool("yes")]), 400, param="tools[0].function.strict")
    server.assert_pool_whole()
