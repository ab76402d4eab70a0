"""Tool-call parsing without a model: the Hermes parser (whole and fed in pieces), the
tool-call stream of each tool_choice, and how tools and tool history reach a chat template
(the template's own way, or the Hermes fallback)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from pagedllm.entrypoints.server.chat_template import (
    hermes_tools_block,
    render_for_template,
    template_reads,
)
from pagedllm.entrypoints.server.tool_parsers import (
    HermesToolParser,
    ParsedCall,
    Piece,
    parser_factory,
)
from pagedllm.entrypoints.server.tool_stream import ToolCallStream
from pagedllm.entrypoints.server.tools import tool_use

FUNCTIONS = ["get_weather", "get_time"]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


def parse(text: str) -> tuple[str | None, list[ParsedCall]]:
    """A whole output through the Hermes parser -> (its content, None if only whitespace
    around calls; its calls)."""
    parser = HermesToolParser(FUNCTIONS)
    pieces = parser.feed(text) + parser.finish()
    content = "".join(p.text for p in pieces)
    calls = [p.call for p in pieces if p.call is not None]
    if calls:
        content = content.strip()
    return (content or None) if calls else content, calls


def test_hermes_one_call_with_text_around() -> None:
    call = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    text = f"Let me look.\n<tool_call>\n{call}\n</tool_call>\nDone."
    content, calls = parse(text)
    assert calls == [ParsedCall("get_weather", '{"city": "Oslo"}')]
    assert content == "Let me look.\n\nDone."
    # Plain text, no call: the content is the text exactly, whitespace included.
    assert parse("  Just text <tool  \n") == ("  Just text <tool  \n", [])


def test_hermes_several_calls_and_spellings() -> None:
    text = (
        '<tool_call>{"name": "get_time", "parameters": {"zone": "UTC"}}</tool_call>'
        '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}</tool_call>'
        '<tool_call>[{"name": "get_time", "arguments": {}}, '
        '{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>'
    )
    content, calls = parse(text)
    assert content is None
    assert calls == [
        ParsedCall("get_time", '{"zone": "UTC"}'),
        ParsedCall("get_weather", '{"city": "Rome"}'),
        ParsedCall("get_time", "{}"),
        ParsedCall("get_weather", '{"city": "Paris"}'),
    ]


@pytest.mark.parametrize(
    "block",
    [
        '<tool_call>{"name": "get_time", "arguments": {"zone": </tool_call>',  # bad JSON
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',  # not offered
        '<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>',  # not an object
        '<tool_call>["get_time"]</tool_call>',  # not a call
        '<tool_call>[{"name": "get_time"}, {"name": "nope"}]</tool_call>',  # one bad: all text
        '<tool_call>{"name": "get_time", "arguments": {}}',  # never closed
    ],
)
def test_hermes_malformed_stays_text(block: str) -> None:
    text = f"Hi {block} bye"
    assert parse(text) == (text, [])


def test_model_output_nested_thousands_deep_is_not_a_call() -> None:
    """A model (unconstrained under "auto") can write JSON nested deeper than any parser's
    recursion: it stays text, and the request goes on."""
    deep_array = "[" * 3000 + "]" * 3000
    deep_object = '{"a":' * 3000 + "1" + "}" * 3000
    for body in (
        deep_array,
        f'{{"name": "get_time", "arguments": {deep_object}}}',
        f'{{"name": "get_time", "arguments": {json.dumps(deep_object)}}}',
    ):
        text = f"Hi <tool_call>{body}</tool_call> bye"
        assert parse(text) == (text, [])
    # "required": an element of the array whose parameters nest that deep is no call.
    stream = ToolCallStream(tool_use([WEATHER, TIME], "required"), HermesToolParser)
    whole = stream.whole(f'[{{"name": "get_time", "parameters": {deep_object}}}]')
    assert whole.calls == []


def test_hermes_fed_in_pieces_agrees_with_whole() -> None:
    text = (
        'A <b> <tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call> end <tool'
    )
    whole = parse(text)
    for size in (1, 2, 3, 7):
        parser = HermesToolParser(FUNCTIONS)
        pieces: list[Piece] = []
        for i in range(0, len(text), size):
            pieces += parser.feed(text[i : i + size])
            # nothing that may open a call is ever sent as text
            assert not any("<tool_call" in p.text for p in pieces)
        pieces += parser.finish()
        assert "".join(p.text for p in pieces) == "A <b>  end <tool"
        assert [p.call for p in pieces if p.call] == whole[1]


def test_parser_registry() -> None:
    assert parser_factory("hermes") is HermesToolParser
    with pytest.raises(ValueError, match="hermes"):
        parser_factory("mistral-ish")


def joined(stream: ToolCallStream, text: str, size: int) -> tuple[str, list[dict]]:
    """Content and calls from the stream fed `size` characters at a time."""
    content, deltas = "", []
    for i in range(0, len(text), size):
        c, d = stream.feed(text[i : i + size])
        content, deltas = content + c, deltas + d
    c, d = stream.finish()
    calls: list[dict] = []
    for delta in deltas + d:
        if "id" in delta:
            assert delta["index"] == len(calls) and delta["type"] == "function"
            assert delta["id"].startswith("call_") and len(delta["id"]) == 29
            calls.append({"name": delta["function"]["name"], "arguments": ""})
        calls[delta["index"]]["arguments"] += delta["function"]["arguments"]
    return content + c, calls


def test_tool_call_streams_of_each_choice() -> None:
    tools = [WEATHER, TIME]
    named = tool_use(tools, {"type": "function", "function": {"name": "get_weather"}})
    required = tool_use(tools, "required")
    auto = tool_use(tools, "auto")
    assert named and required and auto and tool_use(tools, "none") is None
    assert auto.schema is None and named.schema == WEATHER["function"]["parameters"]
    array = (
        '[{"name":"get_time","parameters":{"z":"a]}\\""}},{"name":"get_weather","parameters":{}}]'
    )
    hermes = 'x<tool_call>{"name": "get_time", "arguments": {"z": 1}}</tool_call>'
    for use, text, content, calls in [
        (named, '{"city":"Oslo"}', "", [{"name": "get_weather", "arguments": '{"city":"Oslo"}'}]),
        (
            required,
            array,
            "",
            [
                {"name": "get_time", "arguments": '{"z": "a]}\\""}'},
                {"name": "get_weather", "arguments": "{}"},
            ],
        ),
        (auto, hermes, "x", [{"name": "get_time", "arguments": '{"z": 1}'}]),
    ]:
        for size in (1, 4, 100):
            stream = ToolCallStream(use, HermesToolParser)
            assert joined(stream, text, size) == (content, calls)
        whole = ToolCallStream(use, HermesToolParser).whole(text)
        assert [c["function"] for c in whole.calls] == calls
        assert whole.content == (content or None)
    # auto without a call: the text is the content, exactly
    assert ToolCallStream(auto, HermesToolParser).whole(" hi ").content == " hi "


def test_template_reads_and_hermes_fallback() -> None:
    chatml = SimpleNamespace(chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    qwen = SimpleNamespace(chat_template="{% if tools %}{{ tools }}{% endif %}{{ m.tool_calls }}")
    assert not template_reads(chatml, "tools") and template_reads(qwen, "tools")
    assert not template_reads(SimpleNamespace(chat_template="{{ toolset }}"), "tools")
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Oslo"}},
                },
                {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": {}}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "-3 C"},
        {"role": "tool", "tool_call_id": "c2", "content": "12:00"},
    ]
    # A template that reads both: unchanged.
    assert render_for_template(qwen, history, [WEATHER]) == (history, [WEATHER])
    # One that reads neither: the Hermes format, in the messages.
    messages, tools = render_for_template(chatml, history, [WEATHER])
    assert tools is None
    assert messages[0] == {
        "role": "system",
        "content": "Be brief.\n\n" + hermes_tools_block([WEATHER]),
    }
    assert json.dumps(WEATHER) in messages[0]["content"]
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert messages[2] == {
        "role": "assistant",
        "content": call + '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
    }
    assert messages[3] == {
        "role": "user",
        "content": "<tool_response>\n-3 C\n</tool_response>\n"
        "<tool_response>\n12:00\n</tool_response>",
    }
    assert len(messages) == 4
    # No system message: the tools become one.
    messages, _ = render_for_template(chatml, history[1:2], [TIME])
    assert messages[0] == {"role": "system", "content": hermes_tools_block([TIME])}
