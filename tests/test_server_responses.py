"""The Responses API (`POST /v1/responses`) through a real server, with the official
`openai` client: text and message input on the chat path (same prompt, same tokens as
/v1/chat/completions), the stream's events in order, a function call round trip,
`responses.parse` / `responses.stream` with a pydantic `text_format`, and errors naming
the request's fields. The tiny random model writes JSON or a call only where a grammar
holds it to one."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import Response
from pydantic import BaseModel, Field

from inspect_internals import pause, resume
from live_server import NAME, LiveServer, check_error, event_models
from pagedllm.entrypoints.server.chat_template import encode_chat

HI = [{"role": "user", "content": "Hi there!"}]
GREEDY: dict[str, Any] = {"temperature": 0, "extra_body": {"ignore_eos": True}}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["Oslo", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
# The same tool in chat's shape, as the chat template is given it.
CHAT_WEATHER = {
    "type": "function",
    "function": {k: v for k, v in WEATHER.items() if k != "type"},
}
CALL = (
    r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Oslo|Rome)"\}\}\n</tool_call>'
)


def prompt_len(server: LiveServer, messages: list[dict[str, Any]], **kw: Any) -> int:
    return len(encode_chat(server.engine.engine.tokenizer, messages, **kw))


def test_text_input_runs_as_one_user_message(server: LiveServer) -> None:
    client = server.client()
    r = client.responses.create(model=NAME, input="Hi there!", max_output_tokens=6, **GREEDY)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == NAME
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.status == "incomplete"
    assert item.id.startswith("msg_")
    (part,) = item.content
    assert part.type == "output_text" and part.annotations == []
    assert r.output_text == part.text
    # The chat path: the same prompt gives the same tokens.
    chat = client.chat.completions.create(
        model=NAME,
        messages=HI,  # type: ignore[arg-type]
        max_completion_tokens=6,
        **GREEDY,
    )
    assert part.text == chat.choices[0].message.content
    assert r.usage is not None and chat.usage is not None
    assert r.usage.input_tokens == chat.usage.prompt_tokens == prompt_len(server, HI)
    assert r.usage.output_tokens == 6
    assert r.usage.total_tokens == r.usage.input_tokens + 6
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.max_output_tokens == 6 and r.temperature == 0 and r.tool_choice == "auto"
    # An answer that ends by itself is "completed".
    r = client.responses.create(
        model=NAME, input="Hi there!", extra_body={"guided_choice": ["Oslo"]}
    )
    assert r.status == "completed" and r.incomplete_details is None
    assert r.completed_at is not None and r.completed_at >= r.created_at
    assert r.output_text == "Oslo" and r.output[0].status == "completed"
    server.assert_pool_whole()


def test_every_object_validates_against_the_openai_types(server: LiveServer) -> None:
    """The client builds its objects without checking them; pydantic's validation of the
    same JSON finds a missing or mistyped field."""
    models = event_models()
    for options in (
        {"input": "Hi there!", "max_output_tokens": 4},
        {"input": "Hi there!", "extra_body": {"guided_choice": ["Oslo"]}},
        {
            "input": "Weather?",
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "max_output_tokens": 60,
        },
    ):
        body = {"model": NAME, **options.pop("extra_body", {}), **options}
        whole = httpx.post(server.url + "/v1/responses", json=body, timeout=120)
        assert whole.status_code == 200, whole.text
        Response.model_validate(whole.json())
        stream = {**body, "stream": True}
        with httpx.stream("POST", server.url + "/v1/responses", json=stream, timeout=120) as r:
            lines = list(r.iter_lines())
        names = [line[len("event: ") :] for line in lines if line.startswith("event: ")]
        events = [json.loads(line[len("data: ") :]) for line in lines if line.startswith("data: ")]
        assert names == [e["type"] for e in events] and events
        for event in events:
            models[event["type"]].model_validate(event)
    server.assert_pool_whole()


def test_message_input_with_instructions(server: LiveServer) -> None:
    client = server.client()
    items: list[Any] = [
        {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Hello!", "annotations": []}],
        },
        {"role": "developer", "content": "Answer in one word."},
        {"type": "reasoning", "id": "rs_1", "summary": []},  # left out of the prompt
        {"role": "user", "content": "Again?"},
    ]
    r = client.responses.create(
        model=NAME, instructions="Be brief.", input=items, max_output_tokens=5, **GREEDY
    )
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Again?"},
    ]
    chat = client.chat.completions.create(
        model=NAME,
        messages=messages,  # type: ignore[arg-type]
        max_completion_tokens=5,
        **GREEDY,
    )
    assert r.usage is not None
    assert r.usage.input_tokens == prompt_len(server, messages)
    assert r.output_text == chat.choices[0].message.content
    assert r.instructions == "Be brief."
    server.assert_pool_whole()


def test_stream_events_in_order(server: LiveServer) -> None:
    client = server.client()
    whole = client.responses.create(model=NAME, input="Hi there!", max_output_tokens=5, **GREEDY)
    events = list(
        client.responses.create(
            model=NAME, input="Hi there!", max_output_tokens=5, stream=True, **GREEDY
        )
    )
    types = [e.type for e in events]
    head = [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    tail = [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert types[:4] == head and types[-4:] == tail, types
    deltas = events[4:-4]
    assert deltas and all(e.type == "response.output_text.delta" for e in deltas)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    created, added, done = events[0], events[2], events[-2]
    assert created.response.status == "in_progress" and created.response.output == []
    item_id = added.item.id
    assert all(e.item_id == item_id for e in deltas) and done.item.id == item_id
    text = "".join(e.delta for e in deltas)
    assert text == events[-4].text == done.item.content[0].text == whole.output_text
    final = events[-1].response
    assert final.id == created.response.id and final.status == "incomplete"
    assert final.output_text == whole.output_text and final.usage == whole.usage
    server.assert_pool_whole()


def test_a_stream_the_engine_ends_closes_with_an_error_event(server: LiveServer) -> None:
    stream = server.client().responses.create(
        model=NAME, input="Hi there!", max_output_tokens=400, stream=True, **GREEDY
    )
    events: list[Any] = []
    try:
        for event in stream:
            events.append(event)
            if event.type == "response.output_text.delta" and len(events) == 5:
                # No step runs while paused: the request is ended long before its end.
                pause(server.engine)
                server.engine.end_unfinished("the engine is shutting down")
    finally:
        resume(server.engine)
    last = events[-1]
    assert last.type == "error" and last.code == "server_shutting_down", last
    assert "shutting down" in last.message
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert not any(e.type in ("response.completed", "response.incomplete") for e in events)
    server.assert_pool_whole()


def test_function_call_round_trip(server: LiveServer) -> None:
    client = server.client()
    question = [{"role": "user", "content": "Weather in Oslo?"}]
    r = client.responses.create(
        model=NAME,
        input=question,  # type: ignore[arg-type]
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=60,
    )
    assert r.status == "completed", r.output
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and call.id and call.id.startswith("fc_")
    args = json.loads(call.arguments)
    assert args["city"] in ("Oslo", "Rome")
    # The call and its output go back in the input, as an agent loop sends them.
    turn = [
        *question,
        *[item.model_dump(exclude_none=True) for item in r.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": "-3 C, snow"},
    ]
    r2 = client.responses.create(
        model=NAME,
        input=turn,  # type: ignore[arg-type]
        tools=[WEATHER],  # type: ignore[list-item]
        max_output_tokens=3,
    )
    history = [
        *question,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": args},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "-3 C, snow"},
    ]
    assert r2.usage is not None
    assert r2.usage.input_tokens == prompt_len(server, history, tools=[CHAT_WEATHER])
    server.assert_pool_whole()


def test_auto_tool_call_between_text_streamed_and_whole(server: LiveServer) -> None:
    client = server.client()
    options: dict[str, Any] = dict(
        model=NAME,
        input="Weather in Oslo?",
        tools=[WEATHER],
        max_output_tokens=80,
        temperature=0,
        extra_body={"guided_regex": f"Sure\\. {CALL}\\nDone\\."},
    )
    r = client.responses.create(**options)
    assert r.status == "completed"
    assert [item.type for item in r.output] == ["message", "function_call", "message"]
    first, call, last = r.output
    assert first.content[0].text == "Sure. " and last.content[0].text == "Done."
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Oslo", "Rome")
    events = list(client.responses.create(stream=True, **options))
    types = [e.type for e in events]
    call_events = [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    at = types.index("response.function_call_arguments.delta") - 1
    assert types[at : at + 4] == call_events, types
    assert events[at + 2].arguments == call.arguments
    final = events[-1].response
    assert types[-1] == "response.completed"
    assert [i.type for i in final.output] == ["message", "function_call", "message"]
    assert final.output[1].arguments == call.arguments and final.output_text == r.output_text
    server.assert_pool_whole()


class Lookup(BaseModel):
    word: str = Field(pattern="^[a-z]{1,6}$")
    limit: int = Field(ge=1, le=3)


def test_parse_and_stream_with_a_pydantic_text_format(server: LiveServer) -> None:
    client = server.client()
    options: dict[str, Any] = dict(
        model=NAME, input="Look a word up.", max_output_tokens=60, temperature=0
    )
    parsed = client.responses.parse(text_format=Lookup, **options)
    assert parsed.status == "completed"
    assert isinstance(parsed.output_parsed, Lookup)
    assert parsed.text is not None and parsed.text.format.type == "json_schema"
    with client.responses.stream(text_format=Lookup, **options) as stream:
        types = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.output_text.delta" in types and types[-1] == "response.completed"
    assert final.output_parsed == parsed.output_parsed
    server.assert_pool_whole()


def post(server: LiveServer, **body: Any) -> httpx.Response:
    return httpx.post(server.url + "/v1/responses", json={"model": NAME, **body})


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": "x", "conversation": "conv_1"}, "conversation"),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "max_tokens": 5}, "max_tokens"),
        ({"input": "x", "include": ["message.output_text.logprobs"]}, "include[0]"),
        ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning.effort"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input[0].content[0]",
        ),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        (
            {"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]},
            "input[0].call_id",
        ),
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "1"}]},
            "input[0].arguments",
        ),
        ({"input": []}, "input"),
        # reasoning items stay out of the prompt: the count alone is refused
        ({"input": [{"type": "reasoning"}] * 2048 + [{"role": "user", "content": "x"}]}, "input"),
        ({"input": "x", "tools": [WEATHER] * 129}, "tools"),
        ({"input": "x", "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
        ({"input": "x", "metadata": {"k": "v" * 513}}, "metadata"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "x", "tools": [{**WEATHER, "name": "a b"}]}, "tools[0].name"),
        ({"input": "x", "tools": [{**WEATHER, "parameters": {}}]}, "tools[0].parameters"),
        (
            {"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "f"}},
            "tool_choice.name",
        ),
        ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, "text.format"),
        ({"input": "x", "max_output_tokens": -1}, "max_output_tokens"),
        ({"input": "x", "temperature": "hot"}, "temperature"),
        ({}, "input"),
    ],
)
def test_errors_name_the_field(server: LiveServer, body: dict[str, Any], param: str) -> None:
    check_error(post(server, **body), 400, param=param)


def test_errors_through_the_client(server: LiveServer) -> None:
    client = server.client()
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=NAME, input="x", previous_response_id="resp_1")
    assert isinstance(info.value.body, dict) and info.value.body["param"] == "previous_response_id"
    assert info.value.body["code"] == "unsupported_parameter"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="other", input="x")
    # The body is bounded as on the other routes.
    big = {"model": NAME, "input": "x" * (1 << 20)}
    check_error(httpx.post(server.url + "/v1/responses", json=big), 413, code="request_too_large")
    assert server.rejected(500) == 0
