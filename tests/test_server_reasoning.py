"""Reasoning output through the server (`--reasoning-parser`), with the official `openai`
client, over a real engine: a tiny random Llama with SmolLM2's tokenizer plus `<think>`
and `</think>` as added tokens. logit_bias makes the random model write the tags: it then
reasons in random text, ends the block, and answers.

The raw output is what /v1/completions gives for the same prompt tokens, seed and
sampling: the chat answer must be exactly its split. With a grammar (response_format,
a named tool) the reasoning is drawn freely and only the answer follows the grammar.
The Responses API gives the reasoning as a `reasoning` item before the answer's items."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from openai.types.responses import Response
from pydantic import BaseModel, Field

from hf_oracle import make_tiny_model
from live_server import (
    CHAT,
    NAME,
    LiveServer,
    check_error,
    event_models,
    post_raw,
    smollm2_tokenizer,
    start_server,
)
from pagedllm.entrypoints.server.chat_template import encode_chat
from pagedllm.entrypoints.server.reasoning import REASONING_PARSERS

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def think_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokenizer = smollm2_tokenizer()
    # not special: R1's and Qwen3's think tags are text that detokenizing keeps
    assert tokenizer.add_tokens(["<think>", "</think>"]) == 2
    path = make_tiny_model(
        tmp_path_factory.mktemp("tiny-think"), "llama", vocab_size=len(tokenizer)
    )
    tokenizer.save_pretrained(path)
    return path


def serve(model_dir: Path, parser: str) -> Iterator[LiveServer]:
    live = start_server(model_dir, reasoning_parser=parser)
    yield live
    live.close()


@pytest.fixture(scope="module")
def r1(think_model_dir: Path) -> Iterator[LiveServer]:
    yield from serve(think_model_dir, "deepseek_r1")


@pytest.fixture(scope="module")
def qwen3(think_model_dir: Path) -> Iterator[LiveServer]:
    yield from serve(think_model_dir, "qwen3")


def tag_ids(server: LiveServer) -> tuple[int, int]:
    vocab = server.engine.tokenizer.get_vocab()
    return vocab["<think>"], vocab["</think>"]


def raw(server: LiveServer, **sampling: Any) -> Any:
    """The completion of the chat prompt's tokens: the text the chat answer splits."""
    prompt = encode_chat(server.engine.tokenizer, CHAT, True)
    return server.client().completions.create(model=NAME, prompt=prompt, **sampling)


def chat(server: LiveServer, **body: Any) -> Any:
    return server.client().chat.completions.create(model=NAME, messages=CHAT, **body)


def reasoning_of(message: Any) -> str | None:
    extra = message.model_extra
    assert extra["reasoning"] == extra["reasoning_content"]  # vLLM's two names
    return extra["reasoning_content"]


def streamed(server: LiveServer, **body: Any) -> tuple[str | None, str | None, list[Any]]:
    """(reasoning, content) joined over a stream's deltas (None if none came), its chunks."""
    chunks = list(chat(server, stream=True, **body))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = [d.model_extra.get("reasoning_content") for d in deltas]
    assert reasoning == [d.model_extra.get("reasoning") for d in deltas]
    content = "".join(d.content or "" for d in deltas)
    return "".join(r for r in reasoning if r) or None, content or None, chunks


def test_r1_reasoning_is_the_text_before_the_end_tag(r1: LiveServer) -> None:
    _, end = tag_ids(r1)
    sampling: dict[str, Any] = dict(max_tokens=24, seed=3, logit_bias={str(end): 9})
    text = raw(r1, **sampling).choices[0].text
    before, tag, after = text.partition("</think>")
    assert tag and before and after, text  # the output reasons, ends the block, answers
    whole = chat(r1, **sampling)
    message = whole.choices[0].message
    assert (reasoning_of(message), message.content) == (before, after)
    assert whole.usage.completion_tokens == 24  # the reasoning's tokens count
    # Streamed: the same parts, the reasoning in reasoning_content deltas first.
    reasoning, content, chunks = streamed(r1, **sampling)
    assert (reasoning, content) == (before, after)
    assert chunks[-1].choices[0].finish_reason == "length"
    r1.assert_pool_whole()


def test_r1_without_an_end_tag_is_all_reasoning(r1: LiveServer) -> None:
    _, end = tag_ids(r1)
    sampling: dict[str, Any] = dict(max_tokens=8, seed=1, logit_bias={str(end): -100})
    text = raw(r1, **sampling).choices[0].text
    message = chat(r1, **sampling).choices[0].message
    assert (reasoning_of(message), message.content) == (text, None)
    assert streamed(r1, **sampling)[:2] == (text, None)


def test_qwen3_reasons_only_inside_a_block(qwen3: LiveServer) -> None:
    start, end = tag_ids(qwen3)
    parser = REASONING_PARSERS["qwen3"]
    seen = set()
    for seed in range(6):
        sampling: dict[str, Any] = dict(
            max_tokens=16, seed=seed, logit_bias={str(start): 8, str(end): 8}
        )
        text = raw(qwen3, **sampling).choices[0].text
        want = parser.split(text)
        message = chat(qwen3, **sampling).choices[0].message
        assert (reasoning_of(message), message.content) == want, text
        assert streamed(qwen3, **sampling)[:2] == want
        seen.add((want[0] is not None, text.startswith("<think>")))
    assert (True, False) in seen  # answer text before the block, then reasoning
    # No tag at all: all answer, no reasoning.
    sampling = dict(max_tokens=8, seed=0, logit_bias={str(start): -100})
    text = raw(qwen3, **sampling).choices[0].text
    message = chat(qwen3, **sampling).choices[0].message
    assert (reasoning_of(message), message.content) == (None, text)
    qwen3.assert_pool_whole()


def test_the_grammar_holds_only_the_answer(r1: LiveServer) -> None:
    """The reasoning is drawn freely (random text, not JSON); the answer after the end
    tag follows the schema, streamed and whole."""
    _, end = tag_ids(r1)
    reasoned = 0
    for seed in range(4):
        body: dict[str, Any] = dict(
            response_format=FORMAT,
            max_completion_tokens=60,
            seed=seed,
            logit_bias={str(end): 9},
        )
        whole = chat(r1, **body)
        choice = whole.choices[0]
        reasoning = reasoning_of(choice.message)
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content or ""), SCHEMA)
        if reasoning:
            reasoned += 1
            with pytest.raises(ValueError):
                json.loads(reasoning)
        assert streamed(r1, **body)[:2] == (reasoning, choice.message.content)
    assert reasoned >= 2
    r1.assert_pool_whole()


def test_qwen3_grammar_starts_at_once_unless_the_output_opens_a_block(qwen3: LiveServer) -> None:
    start, end = tag_ids(qwen3)
    body: dict[str, Any] = dict(response_format=FORMAT, max_completion_tokens=60, seed=0)
    # The first token may be <think> (favoured: taken), and the block's end starts the JSON.
    completion = chat(qwen3, logit_bias={str(start): 100, str(end): 100}, logprobs=True, **body)
    message = completion.choices[0].message
    assert completion.choices[0].logprobs.content[0].token == "<think>"
    reasoning = reasoning_of(message)
    assert reasoning is None or set(reasoning.split("<think>")) == {""}, reasoning
    jsonschema.validate(json.loads(message.content or ""), SCHEMA)
    # Unfavoured, the model starts on the JSON (a <think> after that is not the schema's).
    message = chat(qwen3, logit_bias={str(end): 100}, **body).choices[0].message
    assert reasoning_of(message) is None
    jsonschema.validate(json.loads(message.content or ""), SCHEMA)
    qwen3.assert_pool_whole()


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
HERMES_CALL = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "Oslo"\}\}</tool_call>'


def test_tool_calls_are_parsed_from_the_answer_only(r1: LiveServer) -> None:
    _, end = tag_ids(r1)
    bias = {str(end): 9}
    # A named function: its grammar holds the answer, which is the call's arguments.
    choice = chat(
        r1,
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_completion_tokens=40,
        seed=1,
        logit_bias=bias,
    ).choices[0]
    (call,) = choice.message.tool_calls
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")
    assert reasoning_of(choice.message)
    # "auto": a call the answer writes (here held by a regex) is read back; the reasoning
    # before it stays reasoning.
    for stream in (False, True):
        body: dict[str, Any] = dict(
            tools=[WEATHER],
            max_completion_tokens=60,
            seed=1,
            logit_bias=bias,
            extra_body={"guided_regex": HERMES_CALL},
        )
        if stream:
            chunks = list(chat(r1, stream=True, **body))
            deltas = [c.choices[0].delta for c in chunks if c.choices]
            calls = [t for d in deltas for t in d.tool_calls or []]
            assert [t.function.arguments for t in calls] == ['{"city": "Oslo"}']
            assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas)
            assert chunks[-1].choices[0].finish_reason == "tool_calls"
        else:
            choice = chat(r1, **body).choices[0]
            assert choice.finish_reason == "tool_calls"
            assert [c.function.arguments for c in choice.message.tool_calls] == ['{"city": "Oslo"}']
            assert choice.message.content is None and reasoning_of(choice.message)
    r1.assert_pool_whole()


def test_a_grammar_needs_the_think_tokens(chat_model_dir: Path) -> None:
    """SmolLM2's vocabulary has no think tokens: the reasoning still splits as text, but a
    grammar could not tell where the answer starts: 400 naming the field."""
    live = start_server(chat_model_dir, reasoning_parser="deepseek_r1")
    try:
        body = {"model": NAME, "messages": CHAT, "max_tokens": 4, "response_format": FORMAT}
        r = post_raw(f"{live.url}/v1/chat/completions", json.dumps(body))
        check_error(r, 400, param="response_format.json_schema", words=("deepseek_r1", "<think>"))
        message = chat(live, max_tokens=4, seed=0).choices[0].message
        assert message.content is None and reasoning_of(message)  # no </think>: reasoning
        live.assert_pool_whole()
    finally:
        live.close()


def test_completions_are_not_split(r1: LiveServer) -> None:
    _, end = tag_ids(r1)
    text = raw(r1, max_tokens=12, seed=3, logit_bias={str(end): 9}).choices[0].text
    assert "</think>" in text


# ------------------------------------------------------------------ Responses API
def respond(server: LiveServer, **body: Any) -> Any:
    return server.client().responses.create(**{"model": NAME, "input": CHAT, **body})


def respond_raw(server: LiveServer, **body: Any) -> tuple[Response, list[dict[str, Any]]]:
    """The whole response and the stream's events as JSON, each validated against the
    openai package's types (the client builds its objects without checking them)."""
    body = {"model": NAME, "input": CHAT, **body}
    url = server.url + "/v1/responses"
    whole = httpx.post(url, json=body, timeout=120)
    assert whole.status_code == 200, whole.text
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as r:
        lines = list(r.iter_lines())
    events = [json.loads(line[len("data: ") :]) for line in lines if line.startswith("data: ")]
    models = event_models()
    for event in events:
        models[event["type"]].model_validate(event)
    return Response.model_validate(whole.json()), events


def kinds(events: list[Any]) -> list[str]:
    """The events' types, a run of deltas as one."""
    types = [e["type"] if isinstance(e, dict) else e.type for e in events]
    return [t for i, t in enumerate(types) if i == 0 or not (t == types[i - 1] and "delta" in t)]


def items(response: Any) -> list[tuple[str, str]]:
    """(type, text) of each output item: the reasoning's, the message's or the call's."""
    out = []
    for item in response.output:
        if item.type == "function_call":
            out.append((item.type, item.arguments))
        else:
            out.append((item.type, "".join(c.text for c in item.content or ())))
    return out


def test_responses_open_with_a_reasoning_item(r1: LiveServer) -> None:
    _, end = tag_ids(r1)
    sampling: dict[str, Any] = dict(seed=3, logit_bias={str(end): 9})
    before, tag, after = raw(r1, max_tokens=24, **sampling).choices[0].text.partition("</think>")
    assert tag and before and after.strip()
    logprobs = chat(r1, max_tokens=24, logprobs=True, **sampling).choices[0].logprobs
    tokens = [t.token for t in logprobs.content]
    whole = respond(r1, max_output_tokens=24, extra_body=sampling)
    reasoning, message = whole.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_")
    assert reasoning.summary == [] and reasoning.status == "completed"
    assert [(c.type, c.text) for c in reasoning.content] == [("reasoning_text", before)]
    # whitespace between the reasoning and the answer is dropped, as after a call
    assert message.type == "message" and message.status == "incomplete"
    assert whole.output_text == after.lstrip() and whole.status == "incomplete"
    assert whole.usage.output_tokens == 24
    # the reasoning's tokens: through the think-end token
    assert whole.usage.output_tokens_details.reasoning_tokens == tokens.index("</think>") + 1 > 1
    # Streamed: the reasoning item's events, then the message's; the same response.
    events = list(respond(r1, max_output_tokens=24, stream=True, extra_body=sampling))
    assert kinds(events) == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    added, done = events[2], next(e for e in events if e.type == "response.output_item.done")
    assert added.item.type == "reasoning" and added.item.status == "in_progress"
    deltas = [e for e in events if e.type == "response.reasoning_text.delta"]
    assert all(e.item_id == added.item.id and e.content_index == 0 for e in deltas)
    assert "".join(e.delta for e in deltas) == before == done.item.content[0].text
    final = events[-1].response
    assert items(final) == items(whole) and final.usage == whole.usage
    # The same, checked field by field against the openai types.
    checked, raw_events = respond_raw(r1, max_output_tokens=24, **sampling)
    assert items(checked) == items(whole) and kinds(raw_events) == kinds(events)
    # Sent back as input, the reasoning item stays out of the prompt.
    turn = [*CHAT, *[i.model_dump(exclude_none=True) for i in whole.output]]
    more = {"role": "user", "content": "More?"}
    again = respond(r1, input=[*turn, more], max_output_tokens=1)
    history = [*CHAT, {"role": "assistant", "content": whole.output_text}, more]
    prompt = encode_chat(r1.engine.tokenizer, history, True)
    assert again.usage.input_tokens == len(prompt)
    r1.assert_pool_whole()


def test_responses_reasoning_without_an_answer(r1: LiveServer, qwen3: LiveServer) -> None:
    """An output cut in its reasoning is one incomplete reasoning item, all its tokens
    reasoning; an output without any is the message alone."""
    _, end = tag_ids(r1)
    sampling: dict[str, Any] = dict(seed=1, logit_bias={str(end): -100})
    text = raw(r1, max_tokens=8, **sampling).choices[0].text
    for response in (
        respond(r1, max_output_tokens=8, extra_body=sampling),
        list(respond(r1, max_output_tokens=8, stream=True, extra_body=sampling))[-1].response,
    ):
        assert items(response) == [("reasoning", text)] and response.output_text == ""
        assert response.output[0].status == "incomplete" and response.status == "incomplete"
        assert response.usage.output_tokens_details.reasoning_tokens == 8
    start, _ = tag_ids(qwen3)
    sampling = dict(seed=0, logit_bias={str(start): -100})
    text = raw(qwen3, max_tokens=8, **sampling).choices[0].text
    response = respond(qwen3, max_output_tokens=8, extra_body=sampling)
    assert items(response) == [("message", text)]
    assert response.usage.output_tokens_details.reasoning_tokens == 0


class Verdict(BaseModel):
    ok: bool
    n: int = Field(ge=0)


def test_responses_parse_reads_the_answer_after_the_reasoning(r1: LiveServer) -> None:
    _, end = tag_ids(r1)
    client = r1.client()
    reasoned = 0
    for seed in range(3):
        options: dict[str, Any] = dict(
            model=NAME,
            input=CHAT,
            max_output_tokens=60,
            extra_body={"seed": seed, "logit_bias": {str(end): 9}},
        )
        parsed = client.responses.parse(text_format=Verdict, **options)
        assert parsed.status == "completed", parsed.output
        assert isinstance(parsed.output_parsed, Verdict)
        assert parsed.output[-1].type == "message"
        if parsed.output[0].type == "reasoning":
            reasoned += 1
            with pytest.raises(ValueError):  # random text, drawn before the grammar
                json.loads(parsed.output[0].content[0].text)
        with client.responses.stream(text_format=Verdict, **options) as stream:
            final = stream.get_final_response()
        assert final.output_parsed == parsed.output_parsed and items(final) == items(parsed)
    assert reasoned >= 2
    r1.assert_pool_whole()


def test_responses_call_a_function_after_the_reasoning(r1: LiveServer) -> None:
    _, end = tag_ids(r1)
    bias = {str(end): 9}
    tool = {"type": "function", **WEATHER["function"]}
    named = respond(
        r1,
        tools=[tool],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=40,
        extra_body={"seed": 1, "logit_bias": bias},
    )
    assert named.status == "completed"
    reasoning, call = named.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments)["city"] in ("Paris", "Oslo")
    # "auto": the call the answer writes is read back, streamed and whole alike.
    body: dict[str, Any] = dict(
        tools=[tool], max_output_tokens=60, seed=1, logit_bias=bias, guided_regex=HERMES_CALL
    )
    whole, events = respond_raw(r1, **body)
    assert [t for t, _ in items(whole)] == ["reasoning", "function_call"]
    assert whole.output[1].arguments == '{"city": "Oslo"}' and whole.status == "completed"
    assert kinds(events)[2:-1] == [
        "response.output_item.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    final = Response.model_validate(events[-1]["response"])
    assert items(final) == items(whole) and final.usage == whole.usage
    r1.assert_pool_whole()
