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
from pydantic import BaseModel, Field

from live_server import CHAT, NAME, LiveServer, check_error
from pagedllm.engine.prompts import encode_chat

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
