"""Bad client input gets a 4xx naming its field, never a 500: text that is not valid
Unicode, JSON nested too deep, a body that never arrives, fields this server does not
support, and values the engine refuses (each error's `param` is the request's own field
and its `code` the engine's kind of problem). After every test the KV pool is whole."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from live_server import LiveServer, check_error, post_raw, start_server


@pytest.fixture(autouse=True)
def pool_stays_whole(server: LiveServer) -> Iterator[None]:
    yield
    server.assert_pool_whole()


def completion(server: LiveServer, **body: Any) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", json={"max_tokens": 2, **body})


def chat(server: LiveServer, **body: Any) -> httpx.Response:
    body.setdefault("messages", [{"role": "user", "content": "Hi"}])
    return httpx.post(server.url + "/v1/chat/completions", json={"max_tokens": 2, **body})


def test_lone_surrogates_are_a_400_naming_the_field(server: LiveServer) -> None:
    url = server.url + "/v1"
    # Raw bodies: Python's json module would escape nothing here, but a client may send it.
    check_error(
        post_raw(url + "/completions", r'{"prompt":"\ud800x","max_tokens":4}'),
        400,
        param="prompt",
        words=("surrogate",),
    )
    check_error(post_raw(url + "/completions", r'{"prompt":["ok","\udfff"]}'), 400, param="prompt")
    check_error(
        post_raw(url + "/chat/completions", r'{"messages":[{"role":"user","content":"\ud800"}]}'),
        400,
        param="messages[0].content",
    )
    parts = r'[{"type":"text","text":"a"},{"type":"text","text":"\ud800"}]'
    check_error(
        post_raw(
            url + "/chat/completions",
            '{"messages":[{"role":"system","content":"Be brief."},'
            f'{{"role":"user","content":{parts}}}]}}',
        ),
        400,
        param="messages[1].content",
    )
    # An error that quotes the input still is valid JSON (the surrogate is escaped).
    error = check_error(
        post_raw(url + "/completions", r'{"model":"\ud800","prompt":"x"}'), 404, param="model"
    )
    assert "\ud800" in error["message"]


def test_json_nested_too_deep_is_a_400(server: LiveServer) -> None:
    url = server.url + "/v1/completions"
    deep = "[" * 100_000 + "]" * 100_000
    check_error(post_raw(url, deep), 400, code="invalid_json", words=("JSON",))
    nested = '{"prompt": ' + "[" * 5000 + "]" * 5000 + "}"
    check_error(post_raw(url, nested), 400, code="invalid_json")
    shallower = '{"prompt": ' + "[" * 500 + "]" * 500 + "}"  # valid JSON, not a prompt
    check_error(post_raw(url, shallower), 400, param="prompt")


def raw_request(port: int, head: bytes, body: bytes, hang_up: bool = False) -> bytes:
    """Send `head` and `body` on a fresh connection; what comes back until the server
    closes it, or nothing when the client hangs up first."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:  # a hang guard
        sock.sendall(head + body)
        if hang_up:
            return b""
        reply = bytearray()
        while chunk := sock.recv(65536):
            reply += chunk
        return bytes(reply)


def test_a_body_shorter_than_its_content_length_times_out_with_408(chat_model_dir: Path) -> None:
    server = start_server(chat_model_dir, body_timeout=1.0)  # --body-timeout 1
    try:
        check_short_bodies(server)
    finally:
        server.close()


def check_short_bodies(server: LiveServer) -> None:
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100\r\n\r\n"
    )
    reply = raw_request(server.port, head, b'{"prompt": "Hi"')
    assert reply.startswith(b"HTTP/1.1 408 "), reply[:200]
    assert b'"code":"request_timeout"' in reply
    assert server.rejected(408) == 1
    # A client that hangs up in the middle of its body is a client disconnect (499).
    raw_request(server.port, head, b'{"prompt": "Hi"', hang_up=True)
    server.wait_metrics(**{'request_rejected_total{status="499"}': 1})


def test_unsupported_chat_input_is_refused_by_name(server: LiveServer) -> None:
    def messages(*extra: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"role": "system", "content": "Be brief."}, *extra]

    check_error(
        chat(server, messages=messages({"role": "wizard", "content": "Hi"})),
        400,
        param="messages[1].role",
        words=("wizard", "user"),
    )
    check_error(chat(server, messages=messages({"role": "user"})), 400, param="messages[1].content")
    check_error(
        chat(server, messages=messages({"role": "tool", "content": "42"})),
        400,
        param="messages[1].tool_call_id",
    )
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    check_error(
        chat(
            server,
            messages=messages(
                {"role": "user", "content": [{"type": "text", "text": "What is it?"}, image]}
            ),
        ),
        400,
        param="messages[1].content[1]",
        code="unsupported_parameter",
        words=("image_url",),
    )
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    # Tool history is accepted (tests/test_server_tools.py), on the assistant only.
    check_error(
        chat(server, messages=messages({"role": "user", "content": "", "tool_calls": calls})),
        400,
        param="messages[1].tool_calls",
    )
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    for field, value in [
        ("functions", [tool["function"]]),
        ("function_call", "auto"),
    ]:
        check_error(chat(server, **{field: value}), 400, param=field, code="unsupported_parameter")
    check_error(completion(server, prompt="Hi", suffix="!"), 400, param="suffix")
    # echo with max_tokens 0 scores the prompt (tests/test_server_echo.py); without echo,
    # max_tokens 0 asks for nothing.
    check_error(completion(server, prompt="Hi", max_tokens=0), 400, param="max_tokens")
    # What asks for nothing unsupported is served.
    assert chat(server, response_format={"type": "text"}).status_code == 200
    assert chat(server, tools=[], tool_choice="none").status_code == 200
    ok = messages({"role": "developer", "content": "Be kind."}, {"role": "user", "content": "Hi"})
    assert chat(server, messages=ok).status_code == 200


def test_errors_name_the_request_field_and_kind(server: LiveServer) -> None:
    too_long = "hello " * 600
    cases = [
        (completion(server, prompt="Hi", n=1000), "n", "invalid_value"),
        (completion(server, prompt="Hi", n=2, best_of=129), "best_of", "invalid_value"),
        (completion(server, prompt="Hi", stop_token_ids=[10**9]), "stop_token_ids", None),
        (completion(server, prompt="Hi", logprobs=50), "logprobs", "invalid_value"),
        (completion(server, prompt="Hi", logit_bias={"1": 1000}), "logit_bias", None),
        (completion(server, prompt="Hi", logit_bias={"x": 1}), "logit_bias", None),
        (completion(server, prompt="Hi", logit_bias={"1000000": 1}), "logit_bias", None),
        # 100 sequences of up to 101 tokens cannot fit in the 256-block pool; one can.
        (completion(server, prompt="Hi", n=100, max_tokens=100), "n", "kv_cache_exceeded"),
        (completion(server, prompt=""), "prompt", "invalid_value"),
        (completion(server, prompt=[]), "prompt", "invalid_value"),
        (completion(server, prompt=["Hi", ""]), "prompt", "invalid_value"),
        (completion(server, prompt=too_long), "prompt", "context_length_exceeded"),
        (chat(server, messages=[]), "messages", None),
        (
            chat(server, messages=[{"role": "user", "content": too_long}]),
            "messages",
            "context_length_exceeded",
        ),
        (chat(server, max_tokens=600), "max_tokens", "context_length_exceeded"),
        (
            chat(server, max_completion_tokens=600),
            "max_completion_tokens",
            "context_length_exceeded",
        ),
        (chat(server, logprobs=True, top_logprobs=50), "top_logprobs", "invalid_value"),
        (chat(server, top_logprobs=2), "top_logprobs", None),
        (chat(server, n=1000), "n", None),
    ]
    for response, param, code in cases:
        check_error(response, 400, param=param, code=code)
    # best_of picks the n best at the end, which a stream cannot wait for.
    streamed = completion(server, prompt="Hi", n=1, best_of=2, stream=True)
    words = ("best_of must equal n when streaming",)
    check_error(streamed, 400, param="best_of", code="invalid_value", words=words)


def test_stream_options_need_stream(server: LiveServer) -> None:
    words = ("stream_options is only allowed with stream: true",)
    for send in (completion, chat):
        for stream in ({}, {"stream": False}):
            r = send(server, prompt="Hi", stream_options={"include_usage": True}, **stream)
            check_error(r, 400, param="stream_options", code="invalid_value", words=words)
    with httpx.stream(
        "POST",
        server.url + "/v1/completions",
        json={"prompt": "Hi", "max_tokens": 2, "stream": True, "stream_options": {}},
    ) as r:
        assert r.status_code == 200
        assert [line for line in r.iter_lines() if line][-1] == "data: [DONE]"


def test_logit_bias_keys_are_plain_decimal_token_ids(server: LiveServer) -> None:
    # int() reads each of these as a number; none of them is how a token id is written.
    for key in ("1_0", " 10", "10 ", "+10", "１０", "0x10", "1e1", "", "-"):
        r = completion(server, prompt="Hi", logit_bias={key: 1})
        check_error(r, 400, param="logit_bias", code="invalid_value", words=(repr(key),))
    r = chat(server, logit_bias={"1_0": 1})
    check_error(r, 400, param="logit_bias", code="invalid_value", words=("'1_0'",))
    # A negative id is read, and the engine names the range.
    check_error(completion(server, prompt="Hi", logit_bias={"-1": 1}), 400, param="logit_bias")
    assert completion(server, prompt="Hi", logit_bias={"10": 1, "0": -1}).status_code == 200


def test_a_lone_surrogate_in_stop_is_a_400(server: LiveServer) -> None:
    url = server.url + "/v1"
    for body in (
        r'{"prompt":"Hi","max_tokens":2,"stop":"\ud800"}',
        r'{"prompt":"Hi","max_tokens":2,"stop":["ok","a\udfff"]}',
    ):
        check_error(
            post_raw(url + "/completions", body),
            400,
            param="stop",
            code="invalid_value",
            words=("surrogate",),
        )
    error = check_error(
        post_raw(
            url + "/chat/completions",
            r'{"messages":[{"role":"user","content":"Hi"}],"stop":["\ud800"]}',
        ),
        400,
        param="stop",
        code="invalid_value",
    )
    assert error["message"].startswith("stop[0] is not valid Unicode text")


def test_a_value_past_int64_is_a_400_and_a_running_stream_never_notices(
    server: LiveServer,
) -> None:
    """The request that used to fail every other user's stream with a 500."""
    prompt = "Once upon a time"
    want = completion(server, prompt=prompt, max_tokens=24, temperature=0).json()
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0}
    with httpx.stream(
        "POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60
    ) as stream:
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        check_error(
            post_raw(
                server.url + "/v1/completions",
                '{"prompt":"Hi","max_tokens":2,"top_k":1000000000000000000000000000000}',
            ),
            400,
            param="top_k",
            words=("64 bits",),
        )
        for field in ("n", "seed", "logprobs", "max_tokens", "best_of"):
            check_error(completion(server, prompt="Hi", **{field: 2**64}), 400, param=field)
        rest = [line for line in lines if line.startswith("data: ")]
    chunks = [json.loads(line[6:]) for line in [first, *rest] if line != "data: [DONE]"]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == want["choices"][0]["text"] and rest[-1] == "data: [DONE]"
    # A top_k at or above the vocabulary keeps every token, like -1.
    assert completion(server, prompt="Hi", top_k=10**9, temperature=0).status_code == 200
